"""Which held receipts `dpledger verify --receipts` checks, and what it keeps once they check.

A receipts folder (`dpledger.wire.receipt_store`) holds what one account received from every ledger
and silo it spoke to. By default a check reads the receipts of the ledger it talks to (by the key
that signs its log, or the one pinned with --public-key) and of the key it holds: a silo key its own
silo's, an admin's or auditor's every silo's of that ledger. The rest is left aside, and said: the
receipts of other ledgers are no evidence about this one, so they raise no alarm. Receipts that this
very API key received under another log key are the exception: that is this ledger, which changed
the key it signs with (a finding).

When every check holds, the check keeps what it verified beside the receipts: each promise it found
in the log, completed with its index, today's head and the path to it, and today's head as the
newest verified one; the next check holds today's log to both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpledger.audit.outcome import Get, Outcome
from dpledger.audit.transparency import verify_receipts
from dpledger.people.terminal import CliError
from dpledger.wire import receipt_store
from dpledger.wire.enums import Role
from dpledger.wire.receipts import PublicKey, Receipt, SignedTreeHead, default_receipts_dir, key_id
from dpledger.wire.schemas import KeyInfo

DEFAULT_RECEIPTS = Path()  # `--receipts` given without DIR: read at run time, when the environment is final


@dataclass
class Selection:
    receipts: list[Receipt]
    heads: list[SignedTreeHead]  # held beside them: the newest verified one, other completions
    budgets: dict[int, float]  # each silo's budget, as the last check that held verified it
    key_id: str  # the ledger's, as pinned
    public_key: str  # hex, as served (or pinned)
    outcome: Outcome = field(default_factory=Outcome)  # what choosing found (a changed key) and said


def receipts_folder(given: Path) -> Path:
    """The folder `--receipts` names: DIR, or without one where the client keeps them now."""
    return default_receipts_dir() if given is DEFAULT_RECEIPTS else given


def require(folder: Path) -> Path:
    """`folder`, or the one line that says there is nothing there (before any key or ledger is asked)."""
    if not folder.exists():
        raise CliError(f"no receipts at {folder}: the trainer's client keeps them in $DPLEDGER_RECEIPTS")
    return folder


def select(get: Get, folder: Path, *, public_key: str | None, silo: int | None, holder: str) -> Selection:
    """The receipts under `folder` of this ledger and this key (see the module's docstring);
    `holder`: the API key the check runs with (only its fingerprint is compared)."""
    require(folder)
    try:
        held = receipt_store.load(folder)
    except (receipt_store.StoreError, OSError) as error:
        raise CliError(str(error)) from None
    if not held.receipts:
        raise CliError(f"no receipts (*.jsonl) in {folder}")
    served = PublicKey(**get("/v1/log/public-key", None))
    me = KeyInfo(**get("/v1/keys/me", None))
    pinned = key_id(bytes.fromhex(public_key)) if public_key else served.key_id
    own = me.silo_id if me.role is Role.silo else None
    mine = receipt_store.fingerprint(holder)
    out = Outcome()

    def readable(silo_id: int) -> bool:
        return (own is None or silo_id == own) and (silo is None or silo_id == silo)

    chosen = [r for r in held.receipts if receipt_store.key_id_of(r) == pinned and readable(r.silo_id)]
    by_key: dict[str, int] = {}
    for r in held.receipts:
        if receipt_store.key_id_of(r) != pinned:
            by_key[receipt_store.key_id_of(r)] = by_key.get(receipt_store.key_id_of(r), 0) + 1
    changed = sorted(k for k in by_key if any(fp == mine and readable(s) for s, fp in held.holders.get(k, ())))
    for k in changed:
        out.problems.append(
            f"the ledger's signing key changed: {by_key[k]} receipts this key received were signed by key {k[:16]}…, "
            f"the ledger now signs with {pinned[:16]}… (a rewritten log can be signed anew only with a new key)")
    others = {k: n for k, n in by_key.items() if k not in changed}
    if others:
        out.notes.append(f"left aside {sum(others.values())} receipts of {len(others)} other ledger(s), signed by other "
                         f"keys ({', '.join(k[:16] + '…' for k in sorted(others))})")
    aside = sum(1 for r in held.receipts if receipt_store.key_id_of(r) == pinned and not readable(r.silo_id))
    if aside:
        reads = f"silo {own}" if own is not None else f"silo {silo}"
        out.notes.append(f"left aside {aside} receipts of other silos of this ledger (this check reads {reads})")
    if not chosen and not out.problems:
        whose = f" of silo {own if own is not None else silo}" if own is not None or silo is not None else ""
        raise CliError(f"no receipts of this ledger (key {pinned[:16]}…){whose} in {folder}; "
                                  + "; ".join(out.notes))
    return Selection(chosen, held.heads.get(pinned, []), held.budgets.get(pinned, {}), pinned,
                     public_key or served.public_key, out)


def check(get: Get, folder: Path, *, public_key: str | None, silo: int | None, holder: str, keep: bool = True,
          **verify: Any) -> Outcome:
    """`select`, then `verify_receipts` of what it chose; when all holds, keeps the completions and the
    head (`keep`) where the receipts are (a folder, or the folder of a single file given)."""
    chosen = select(get, folder, public_key=public_key, silo=silo, holder=holder)
    out = chosen.outcome
    if not chosen.receipts:
        return out
    checked = verify_receipts(get, chosen.receipts, public_key=public_key, heads=chosen.heads, budgets=chosen.budgets,
                              **verify)
    out.problems += checked.problems
    out.notes[:0] = checked.notes
    out.evidence += checked.evidence
    out.unasked += checked.unasked
    out.head, out.completions = checked.head, checked.completions
    if keep and out.ok and out.head is not None:
        root = folder if folder.is_dir() else folder.parent
        receipt_store.append(root, out.completions)
        saved = receipt_store.save_head(root, out.head, chosen.public_key, checked.budgets)
        completed = f", {len(out.completions)} receipts completed" if out.completions else ""
        out.notes.append(f"kept the head of size {out.head.tree_size} in {saved}{completed}")
    return out
