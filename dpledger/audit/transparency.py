"""The transparency log checked by a party that does not trust whoever runs the ledger (what
`dpledger verify --receipts DIR` and `dpledger audit --since HEAD_FILE` run; `commands` holds them).

- A silo holds the receipts its answers came with. It checks that each is signed by the key it
  pinned, that each entry is still in the log with the content that was signed (the leaf recomputed
  from the record the API serves now), and that the current head extends the newest head it holds.
- An auditor holds the last head it verified. It checks that the current head extends it, that the
  leaves the log serves make the signed root, and that every silo's entries state the ε that
  dp-accounting composes from their charges' mechanisms (never from the stored running sums:
  `recompose`).

Two validly signed heads of one size with different roots are a proof of misbehaviour: it is
printed as JSON that anyone holding the public key can check. Exit
codes as `dpledger verify`: 0 all checks hold, 1 misbehaviour found, 2 could not ask.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from dpledger.audit.outcome import Get, Outcome
from dpledger.audit.recompose import Composition, Replays, compose_silo, same_epsilon
from dpledger.people import terminal
from dpledger.wire import merkle
from dpledger.wire.client import LedgerClient, Retry
from dpledger.wire.errors import LedgerError, Rejected
from dpledger.wire.log_proofs import MAX_PROOFS, LogProofs
from dpledger.wire.receipts import (
    ConsistencyProof,
    HeadError,
    LogLeaf,
    PublicKey,
    Receipt,
    SignedTreeHead,
    check_receipt,
    key_id,
    record_leaf_hash,
    verify_head,
)

# Leaves per request (/v1/log/leaves gives up to 10,000): small pages keep the ledger serving the next
# one while the auditor checks this one, from the first page to the last.
PAGE = 2_000
SILO_PAGE = 10_000  # a silo's own leaves per request (the most /v1/log/leaves gives)
T = TypeVar("T")


class RefusedError(terminal.CliError):
    """The ledger refused a read (a 4xx status): a finding where a proof was asked for."""


def _hex(values: list[str]) -> list[bytes]:
    return [bytes.fromhex(v) for v in values]


def check_extends(get: Get, held: SignedTreeHead, current: SignedTreeHead, public_key: bytes, out: Outcome, *,
                  proof: list[bytes] | None = None, ask_past: bool = True) -> int:
    """The current head extends `held` (both already verified under `public_key`), or the evidence why not.
    `proof`: the consistency path, if already fetched. Returns how many past heads it asked for (0 or 1):
    with `ask_past` off, an inconsistency is reported without asking for the head that proves it."""
    if current.tree_size < held.tree_size:
        # Found, but not a proof for third parties: the ledger signs past sizes' heads on request too.
        # Once the log regrows past the held size, the same rewrite is a fork, which is one.
        out.problems.append(f"the log shrank from {held.tree_size} to {current.tree_size} leaves: entries were removed")
        return 0
    if current.tree_size == held.tree_size:
        if current.root_hash != held.root_hash:
            out.fork(held, current, public_key, f"FORK: two signed heads of size {held.tree_size} with different roots")
        return 0
    if proof is None:
        proof = _hex(ConsistencyProof(**get("/v1/log/proofs/consistency",
                                            {"first": held.tree_size, "second": current.tree_size})).path)
    try:
        merkle.verify_consistency(first=held.tree_size, second=current.tree_size, first_root=bytes.fromhex(held.root_hash),
                                  second_root=bytes.fromhex(current.root_hash), path=proof)
        return 0
    except merkle.ProofError as error:
        reason = str(error)
    if not ask_past:
        out.problems.append(f"the current head (size {current.tree_size}) is not consistent with the head of size "
                            f"{held.tree_size} held: {reason}")
        return 0
    # Ask the ledger to sign its head at the size held: a different root is a fork anyone can check.
    past = SignedTreeHead(**get("/v1/log/head", {"size": held.tree_size}))
    try:
        verify_head(past, public_key)
    except HeadError as error:
        out.problems.append(f"the head the ledger signed for size {held.tree_size} does not verify: {error}")
        return 1
    if past.root_hash != held.root_hash:
        out.fork(held, past, public_key, f"FORK: two signed heads of size {held.tree_size} with different roots "
                                         "(the log before it was rewritten, and after)")
    else:
        out.problems.append(f"the current head (size {current.tree_size}) is not consistent with the head of size "
                            f"{held.tree_size} held: {reason}")
    return 1


def _pinned_key(get: Get, pinned_id: str, explicit: str | None, out: Outcome) -> bytes | None:
    """The public key to check with: given, or the served one if it is the key the party pinned."""
    served = PublicKey(**get("/v1/log/public-key", None))
    if served.key_id != pinned_id:
        out.problems.append(
            f"the ledger's signing key changed: what this party holds was signed by key {pinned_id[:16]}…, "
            f"the ledger now signs with {served.key_id[:16]}… (a rewritten log can be signed anew only with a new key)"
        )
        return None
    return bytes.fromhex(explicit) if explicit else bytes.fromhex(served.public_key)


def current_head(get: Get, public_key: bytes, out: Outcome) -> SignedTreeHead | None:
    head = SignedTreeHead(**get("/v1/log/head", None))
    try:
        verify_head(head, public_key)
    except HeadError as error:
        out.problems.append(f"the current head: {error}")
        return None
    out.head = head
    return head


def verify_receipts(get: Get, receipts: list[Receipt], *, public_key: str | None = None,
                    clock: Callable[[], float] = time.time, heads: Sequence[SignedTreeHead] = (),
                    budgets: Mapping[int, float] | None = None) -> Outcome:
    """A silo's check of the receipts it holds (see the module's docstring). About ten requests
    whatever the number of receipts: the silo's leaves in one page, every proof in one batch. A
    receipt that holds only a promise is found in the log by its leaf; while one is missing and its
    deadline is ahead, the log is read again (every `WAIT_S`, never past the latest deadline); one
    still missing from a head signed after its deadline is a broken promise, printed as evidence.
    `heads`: heads held beside the receipts (the newest one verified before, other completions), each
    checked for consistency with today's log like the receipts' own. Each promise found in the log
    comes back completed (`Outcome.completions`: its index, today's head and the path to it).
    `budgets`: each silo's budget as this party last verified it; a silo served with another is named,
    with both numbers (a seal of an edited budget leaves no signed record of the one before)."""
    out = Outcome()
    if not receipts:
        out.problems.append("no receipts to check")
        return out
    key_ids = sorted({k for r in receipts for k in _key_ids(r)})
    if len(key_ids) > 1:
        out.problems.append(f"the receipts were signed by {len(key_ids)} different keys: {[k[:16] for k in key_ids]}")
    key = _pinned_key(get, key_ids[-1] if public_key is None else key_id(bytes.fromhex(public_key)), public_key, out)
    if key is None:
        return out
    held: list[Receipt] = []
    for r in receipts:
        try:
            check_receipt(r, key)
            held.append(r)
        except HeadError as error:
            out.problems.append(f"receipt of silo {r.silo_id} entry {r.seq}: {error}")
    by_size: dict[int, SignedTreeHead] = {}
    kept_heads = []
    for head in heads:
        try:
            verify_head(head, key)
            kept_heads.append(head)
        except HeadError as error:
            out.problems.append(f"a head held beside the receipts: {error}")
    for head in [r.tree_head for r in held if r.tree_head is not None] + kept_heads:
        earlier = by_size.setdefault(head.tree_size, head)
        if earlier.root_hash != head.root_hash:
            out.fork(earlier, head, key, f"FORK: two signed heads of size {earlier.tree_size} with different roots")
    silo_ids = sorted({r.silo_id for r in held})
    while True:
        checking = Outcome()
        current = current_head(get, key, checking)
        if current is None or not held:
            out.problems += checking.problems
            return out
        leaves = {silo_id: _silo_leaves(get, silo_id, current.tree_size) for silo_id in silo_ids}
        placed = {id(r): _place(r, leaves[r.silo_id]) for r in held}
        waiting = [r for r in held if placed[id(r)] is None and r.promise is not None and r.promise.deadline > current.timestamp]
        latest = max((r.promise.deadline for r in waiting if r.promise is not None), default=0)
        if not waiting or clock() * 1000 >= latest:
            break
        time.sleep(WAIT_S)  # the sequencer runs every 100 ms: most waits end at the first read again
    out.head = checking.head
    # Every distinct head held, not only the newest: after a rewrite, heads the silo got before it
    # contradict the new log even when the newest (signed after it) does not.
    heads = sorted(by_size.values(), key=lambda h: h.tree_size)
    inclusion, consistency = _proofs(get, current.tree_size, sorted(i for found in leaves.values() for i in found),
                                     [h.tree_size for h in heads if 0 < h.tree_size < current.tree_size])
    asked_past = 0
    for head in heads:
        asked_past += check_extends(get, head, current, key, out, proof=consistency.get(head.tree_size),
                                    ask_past=asked_past < MAX_PAST_HEADS)
    for r in held:
        _check_held_entry(get, r, placed[id(r)], leaves[r.silo_id], inclusion, current, key, out)
        index = placed[id(r)]
        if not r.included and index is not None and index < current.tree_size and index in inclusion:
            done = r.model_copy(update={"log_index": index, "tree_head": current,
                                        "inclusion_path": [p.hex() for p in inclusion[index]]})
            try:
                check_receipt(done, key)
                out.completions.append(done)
            except HeadError:
                pass  # _check_held_entry named it: the signed leaf is not in the current log
    receipted = {index for index in placed.values() if index is not None}
    for silo_id in silo_ids:
        _check_silo(get, silo_id, leaves[silo_id], inclusion, receipted, current, key, out,
                    verified_budget=(budgets or {}).get(silo_id))
    out.notes.append(f"{len(held)} receipts, {len(heads)} distinct heads and {sum(map(len, leaves.values()))} entries "
                     f"of silo {', '.join(map(str, silo_ids))} against the head of size {current.tree_size}")
    return out


WAIT_S = 0.1


def _key_ids(r: Receipt) -> set[str]:
    return {k.key_id for k in (r.promise, r.tree_head) if k is not None}


def _place(r: Receipt, leaves: dict[int, LogLeaf]) -> int | None:
    """The log index of a receipt's entry: the one it names, else the silo's leaf with its leaf hash,
    else None (its leaf is not in the log: a promise broken once its deadline passed, even where
    another leaf now stands for the same entry, as in a log that was cut and grew again)."""
    if r.log_index is not None:
        return r.log_index
    for index, leaf in leaves.items():
        if leaf.leaf_hash == r.leaf_hash:
            return index
    return None


MAX_PAST_HEADS = 1  # past heads asked for to turn an inconsistent held head into a fork proof (one proof suffices)


def _silo_leaves(get: Get, silo_id: int, size: int) -> dict[int, LogLeaf]:
    """The silo's own leaves below `size`, with their records, by log index."""
    found: dict[int, LogLeaf] = {}
    start = 0
    while True:
        page = [LogLeaf(**leaf) for leaf in get("/v1/log/leaves", {"silo_id": silo_id, "start": start, "limit": SILO_PAGE})]
        found.update((leaf.log_index, leaf) for leaf in page if leaf.log_index < size)
        if len(page) < SILO_PAGE:
            return found
        start = page[-1].log_index + 1


def _proofs(get: Get, size: int, indices: list[int], firsts: list[int]) -> tuple[dict[int, list[bytes]], dict[int, list[bytes]]]:
    """Inclusion paths of `indices` and consistency paths from `firsts`, all to the tree of `size`."""
    inclusion: dict[int, list[bytes]] = {}
    consistency: dict[int, list[bytes]] = {}
    for i in range(0, max(len(indices), len(firsts)), MAX_PROOFS):
        answer = LogProofs(**get("/v1/log/proofs", {
            "size": size, "inclusion": ",".join(map(str, indices[i:i + MAX_PROOFS])),
            "consistency": ",".join(map(str, firsts[i:i + MAX_PROOFS])),
        }))
        inclusion.update((p.log_index, _hex(p.path)) for p in answer.inclusion)
        consistency.update((p.first, _hex(p.path)) for p in answer.consistency)
    return inclusion, consistency


def _check_held_entry(get: Get, r: Receipt, index: int | None, leaves: dict[int, LogLeaf],
                      inclusion: dict[int, list[bytes]], current: SignedTreeHead, public_key: bytes, out: Outcome) -> None:
    if index is None:  # a promise only, and no leaf of its entry in the log
        assert r.promise is not None  # a receipt without inclusion carries a promise (Receipt's validator)
        name = f"silo {r.silo_id} entry {r.seq} (leaf {r.leaf_hash[:16]}…)"
        standing = next((i for i, leaf in leaves.items() if _names(leaf, r.silo_id, r.seq)), None)
        instead = "" if standing is None else f"; log index {standing} now holds another leaf for that entry"
        if r.promise.deadline <= current.timestamp:
            why = (f"BROKEN PROMISE: {name} was promised in the log by {_when(r.promise.deadline)}; the head of size "
                   f"{current.tree_size} signed at {_when(current.timestamp)} does not hold it{instead}")
            out.problems.append(why)
            evidence: dict[str, Any] = {"misbehaviour": why, "public_key": public_key.hex(),
                                        "promise": r.promise.model_dump(), "head": current.model_dump()}
            every = _head_leaves(get, current)
            if every is not None:  # the head's every leaf: anyone recomputes its root and sees the promised one absent
                evidence["leaf_hashes"] = every
            out.problems.extend([] if every is not None else [
                f"{name}: the log's leaves do not make the root of the head of size {current.tree_size}"])
            out.evidence.append(evidence)
        else:
            out.problems.append(f"{name}: not in the log yet, though promised by {_when(r.promise.deadline)} "
                                f"(check again after it){instead}")
        return
    name = f"silo {r.silo_id} entry {r.seq} (log index {index})"
    if index >= current.tree_size:
        out.problems.append(f"{name}: the log has only {current.tree_size} leaves now")
        return
    leaf = leaves.get(index)
    if leaf is None or leaf.record is None:
        out.problems.append(f"{name}: the leaf at that index is no longer this silo's entry")
        return
    record = parse_record(leaf.record)
    if record is None:
        out.problems.append(f"{name}: the ledger serves a record for it that is not an entry's ({leaf.record[:60]!r}…)")
    elif (record["entry"].get("silo_id"), record["entry"].get("seq")) != (r.silo_id, r.seq):
        entry = record["entry"]
        out.problems.append(f"{name}: the leaf at that index is now silo {entry.get('silo_id')} entry {entry.get('seq')}")
    if record_leaf_hash(leaf.record) != r.leaf_hash:
        out.problems.append(f"{name}: the entry now reads differently from what the ledger signed "
                            f"(its record hashes to {record_leaf_hash(leaf.record)[:16]}…, the receipt says {r.leaf_hash[:16]}…)")
    try:
        merkle.verify_inclusion(index=index, size=current.tree_size, leaf=bytes.fromhex(r.leaf_hash),
                                path=inclusion.get(index, []), root_hash=bytes.fromhex(current.root_hash))
    except merkle.ProofError as error:
        out.problems.append(f"{name}: the signed leaf is not in the current log: {error}")


def parse_record(text: str | None) -> dict[str, Any] | None:
    """A leaf's record as JSON with an `entry` and a `subject` object, or None: a record the ledger
    serves is data to check, never trusted to be well formed."""
    if text is None:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("entry"), dict) or not isinstance(record.get("subject"), dict):
        return None
    return record


def _names(leaf: LogLeaf, silo_id: int, seq: int) -> bool:
    """Whether the leaf's record (where the caller may read it) is this silo's entry `seq`."""
    record = parse_record(leaf.record)
    return record is not None and (record["entry"].get("silo_id"), record["entry"].get("seq")) == (silo_id, seq)


MAX_PROOF_LEAVES = 20_000  # a broken promise's proof lists the head's leaves up to this size (1.3 MB of hex)


def _head_leaves(get: Get, head: SignedTreeHead) -> list[str] | None:
    """Every leaf hash of the tree `head` signs, checked to make its root; [] past MAX_PROOF_LEAVES
    (the proof then names the head only: anyone reads its leaves from the log), None if they do not."""
    if head.tree_size > MAX_PROOF_LEAVES:
        return []
    hashes = [leaf.leaf_hash for page in _pages(get, head.tree_size) for leaf in page if leaf.log_index < head.tree_size]
    if merkle.root(_hex(hashes)).hex() != head.root_hash:
        return None
    return hashes


def _when(milliseconds: int) -> str:
    return datetime.fromtimestamp(milliseconds / 1000, UTC).isoformat(timespec="milliseconds")


def _check_silo(get: Get, silo_id: int, leaves: dict[int, LogLeaf], inclusion: dict[int, list[bytes]], receipted: set[int],
                current: SignedTreeHead, public_key: bytes, out: Outcome, *, verified_budget: float | None = None) -> None:
    """The silo's whole history as the signed log holds it (its entries with no receipt too, its create
    entry first): each leaf in the current head, each record its leaf's, and then the ε each entry states,
    the budget and the filter, recomposed from the mechanisms with the service's accounting code.

    Only signed data is recomposed: the records that hash to their leaves, in the current head, up to
    the first that does not (an edited record says nothing the ledger signed, and every ε after it
    depends on it). So what the replay finds is a proof: those entries, their paths and the head."""
    signed: list[tuple[int, LogLeaf, dict[str, Any]]] = []
    cut: int | None = None  # the first log index whose record is not what the ledger signed
    for index, leaf in sorted(leaves.items()):
        if leaf.record is None:
            continue
        matches = record_leaf_hash(leaf.record) == leaf.leaf_hash
        try:
            merkle.verify_inclusion(index=index, size=current.tree_size, leaf=bytes.fromhex(leaf.leaf_hash),
                                    path=inclusion.get(index, []), root_hash=bytes.fromhex(current.root_hash))
            in_head = True
        except merkle.ProofError as error:
            in_head = False
            if index not in receipted:  # a receipt's entry is named above, by what it signed
                out.problems.append(f"silo {silo_id} log index {index}: its leaf is not in the current log: {error}")
        if not matches and index not in receipted:
            out.problems.append(f"silo {silo_id} log index {index}: its entry no longer matches its leaf "
                                "(edited after it was logged)")
        record = parse_record(leaf.record)
        if record is None and matches:
            out.problems.append(f"silo {silo_id} log index {index}: the ledger signed a record that is not an entry "
                                f"({leaf.record[:60]!r}…)")
        if cut is None and matches and in_head and record is not None:
            signed.append((index, leaf, record))
        elif cut is None:
            cut = index
    if cut is not None:
        out.notes.append(f"silo {silo_id}: its ε is recomposed from its signed entries before log index {cut} only: "
                         "the record served there is not what the ledger signed")
    before = len(out.problems)
    # Nothing signed before the first edited record (its create entry was edited): nothing to recompose.
    composed = compose_silo(silo_id, [record for _, _, record in signed], out) if signed or cut is None else None
    if len(out.problems) > before:
        # The ledger signed these entries (each in the head below, by its path): anyone with the key and
        # dp-accounting can recompose them and see that what they state is not what they compose to.
        out.evidence.append({
            "misbehaviour": f"silo {silo_id}: " + "; ".join(out.problems[before:before + 3]),
            "public_key": public_key.hex(), "head": current.model_dump(),
            "entries": [{"log_index": i, "record": leaf.record, "inclusion_path": [p.hex() for p in inclusion.get(i, [])]}
                        for i, leaf, _ in signed],
        })
    if composed is not None:
        out.budgets[silo_id] = composed.budget
    _compare_served(get, silo_id, composed, out, whole=cut is None, before=verified_budget)


def budget_went(silo_id: int, before: float | None, now: Any, out: Outcome) -> None:
    """A silo whose budget is not the one this party last verified: said with both numbers."""
    if before is not None and now != before:
        out.problems.append(f"silo {silo_id}: its budget went from ε={before:g}, as last verified, to ε={now} now")


def _compare_served(get: Get, silo_id: int, composed: Composition | None, out: Outcome, *, whole: bool = True,
                    before: float | None = None) -> None:
    """What the ledger serves as the silo's budget, filter and ε now, against its own signed entries
    (its ε only where `whole`: every entry was recomposed; only whether it serves the silo at all
    where nothing was)."""
    try:
        detail = get(f"/v1/silos/{silo_id}", None)
    except RefusedError as error:  # a tampered record is refused by name (409): a finding, not a failure to ask
        out.problems.append(f"silo {silo_id}: the ledger refuses to serve the silo: {error}")
        return
    except terminal.CliError as error:  # could not ask about this silo: the others are still checked
        out.unasked.append(f"silo {silo_id}: {error}")
        return
    if not isinstance(detail, dict):
        out.problems.append(f"silo {silo_id}: the ledger serves the silo as {str(detail)[:60]!r}, not a silo's record")
        return
    budget_went(silo_id, before, detail.get("epsilon"), out)
    if composed is None:
        return
    name = f"silo {silo_id}"
    for field_name, signed in (("epsilon", composed.budget), ("delta", composed.delta)):
        if detail.get(field_name) != signed:
            out.problems.append(f"{name}: the ledger serves {field_name}={detail.get(field_name)!r}, "
                                f"but its signed {composed.record_event} entry fixed {signed!r}")
    if composed.spec is not None:
        found = detail.get("filter") or {}
        served: dict[str, Any] = found if isinstance(found, dict) else {}
        shown: list[list[Any]] = [v if isinstance(v := served.get(k), list) else [] for k in ("orders", "weights")]
        if (tuple(shown[0]), tuple(shown[1])) != (composed.spec.orders, composed.spec.weights):
            out.problems.append(f"{name}: the ledger serves a filter other than the one its signed "
                                f"{composed.record_event} entry fixed (orders {served.get('orders')} "
                                f"weights {served.get('weights')})")
    if composed.retired_seq is not None and detail.get("retired_seq") != composed.retired_seq:
        out.problems.append(f"{name}: its signed entry {composed.retired_seq} retired it, but the ledger serves it "
                            f"with retired_seq={detail.get('retired_seq')!r}")
    if not whole:
        return
    try:
        stated = math.inf if detail.get("epsilon_spent") is None else float(detail["epsilon_spent"])
    except (TypeError, ValueError):
        out.problems.append(f"{name}: the ledger serves ε spent as {detail.get('epsilon_spent')!r}, not a number")
        return
    if not same_epsilon(stated, composed.epsilon):
        out.problems.append(f"{name}: the ledger says ε={stated:.6g} is spent now, but the mechanisms of its "
                            f"signed entries compose to ε={composed.epsilon:.6g}")


# --- the auditor ------------------------------------------------------------------------------------

def audit(get: Get, held: dict[str, Any] | None) -> Outcome:
    """An auditor's check against the head file it holds (None on first use: the key is pinned then)."""
    out = Outcome()
    if held is None:
        served = PublicKey(**get("/v1/log/public-key", None))
        key = bytes.fromhex(served.public_key)
        out.notes.append(f"first audit: pinning the ledger's key {served.key_id[:16]}… (compare it with `dpledger pubkey` "
                         "from a channel you trust)")
        previous = None
    else:
        previous = SignedTreeHead(**held["head"])
        found = _pinned_key(get, key_id(bytes.fromhex(held["public_key"])), held["public_key"], out)
        if found is None:
            return out
        key = found
    head = current_head(get, key, out)
    if head is None:
        return out
    if previous is not None:
        check_extends(get, previous, head, key, out)
    _check_leaves(get, head, out)
    before = {int(k): v for k, v in (held or {}).get("budgets", {}).items()} if held is not None else {}
    if before:  # a budget edited and sealed leaves no signed record of the one before: the head file has it
        listed = get("/v1/silos", None)
        budgets_now = {s.get("id"): s.get("epsilon") for s in listed if isinstance(s, dict)} if isinstance(listed, list) else {}
        for silo_id, budget in sorted(before.items()):
            if silo_id in budgets_now:
                budget_went(silo_id, budget, budgets_now[silo_id], out)
    out.notes.append(f"head of size {head.tree_size}, root {head.root_hash[:16]}…")
    return out


def _check_leaves(get: Get, head: SignedTreeHead, out: Outcome) -> None:
    """Every leaf the head signs, each record its leaf's, and every silo's ε recomposed (`_replay`)."""
    leaves: list[LogLeaf] = []
    replays = Replays(out)
    for page in _pages(get, head.tree_size):
        for leaf in page:  # checked as each page arrives, while the ledger serves the next
            if leaf.log_index >= head.tree_size:
                break
            leaves.append(leaf)
            if leaf.record is None:
                out.problems.append(f"log index {leaf.log_index}: no entry behind the leaf (it was deleted)")
                continue
            record = parse_record(leaf.record)
            silo_id = record["entry"].get("silo_id") if record is not None else None
            if record_leaf_hash(leaf.record) != leaf.leaf_hash:
                out.problems.append(f"log index {leaf.log_index}: the entry no longer matches its leaf "
                                    "(edited after it was logged)")
                # Not what the ledger signed: that silo is recomposed up to here only (signed data alone).
                replays.halt(silo_id, f"log index {leaf.log_index}")
                continue
            if record is None or not isinstance(silo_id, int):
                out.problems.append(f"log index {leaf.log_index}: the ledger signed a record that is not an entry "
                                    f"({leaf.record[:60]!r}…)")
                continue
            replays.feed(record, silo_id)
    if [leaf.log_index for leaf in leaves] != list(range(head.tree_size)):
        out.problems.append(f"the log serves {len(leaves)} leaves, not the {head.tree_size} its head signs")
        return
    if merkle.root(_hex([leaf.leaf_hash for leaf in leaves])).hex() != head.root_hash:
        out.problems.append("the leaves the log serves do not make the root its head signs")
    replays.finish()


def _pages(get: Get, size: int) -> Iterator[list[LogLeaf]]:
    """The log's leaves below `size`, page by page, each next page asked for while the caller checks
    this one: the ledger's serving and the auditor's checking overlap instead of taking turns."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        def fetch(start: int) -> list[LogLeaf]:
            return _LEAF_PAGE.validate_python(get("/v1/log/leaves", {"start": start, "limit": PAGE}))

        start = 0
        pending: Future[list[LogLeaf]] | None = pool.submit(fetch, start)
        while pending is not None:
            page = pending.result()
            start += len(page)
            pending = pool.submit(fetch, start) if len(page) == PAGE and start < size else None
            yield page


# A page validated in one call (pydantic's core), not 10,000 model constructions from Python.
_LEAF_PAGE: TypeAdapter[list[LogLeaf]] = TypeAdapter(list[LogLeaf])


# --- asking the ledger -----------------------------------------------------------------------------

def http_get(path: str, params: dict[str, Any] | None) -> Any:
    """The checker's `Get` over the ledger's typed client, one kept-alive connection for the whole
    check: a check makes tens of requests, and a fresh connection each spends ~30 ms building its
    TLS context alone."""
    return ask(lambda client: client.read(path, params))


def ask(call: Callable[[LedgerClient], T]) -> T:
    """`call` on the cached client, its errors as `dpledger`'s: a 4xx other than 401 is a refusal
    (RefusedError, a finding where a proof was asked for), the rest could-not-ask (CliError)."""
    try:
        return call(_client(terminal.ledger_url(), terminal.ledger_key()))
    except Rejected as error:
        if error.status_code == 401:
            raise terminal.CliError(terminal.said(error)) from None
        raise RefusedError(terminal.said(error)) from None
    except LedgerError as error:
        raise terminal.CliError(terminal.said(error)) from None


@functools.lru_cache(maxsize=4)
def _client(url: str, key: str) -> LedgerClient:
    return LedgerClient(url, key, retry=Retry(window=0), timeout=120.0, receipts=False)


def _proof_header(evidence: dict[str, Any]) -> str:
    if "heads" in evidence:
        return "two heads signed by the ledger's key that cannot both be honest"
    if "promise" in evidence:
        return ("the ledger's key promised this leaf in the log by a deadline; its head signed after the deadline "
                "does not hold it")
    return "entries the ledger's key signed, in the head below, whose ε or budget does not recompose from their own mechanisms"


def report(out: Outcome, *, proof: Callable[[dict[str, Any]], str] = _proof_header, of: str = "") -> int:
    """Prints each proof of misbehaviour (headed by `proof` of it), the notes, the problems (`of`: what
    they are problems with); the exit code."""
    for evidence in out.evidence:
        print(f"PROOF OF MISBEHAVIOUR ({proof(evidence)}):")
        print(json.dumps(evidence, indent=2))
    for note in out.notes:
        print(f"ok: {note}" if out.ok else f"note: {note}")
    if out.ok:
        return 0
    if out.problems:
        print(f"BROKEN: {len(out.problems)} problem(s){of}")
        for problem in out.problems:
            print(f"  - {problem}")
    for unasked in out.unasked:  # said even beside a finding: that part was not checked
        print(f"dpledger: could not ask: {unasked}", file=sys.stderr)
    return terminal.EXIT_BROKEN if out.problems else terminal.EXIT_FAILED


def guarded(get: Get) -> Get:
    """`get`, with a body that is not the shape the API documents said as could-not-ask (one line)."""

    def checked(path: str, params: dict[str, Any] | None) -> Any:
        try:
            return get(path, params)
        except (ValidationError, TypeError) as error:  # a body that is not what the API documents
            raise terminal.CliError(f"{path} answered something that is not its documented shape: {error}") from None

    return checked

