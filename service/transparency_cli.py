"""`dpledger verify --receipts DIR`, `dpledger audit --since HEAD_FILE`, `dpledger pubkey`: the
transparency log checked by a party that does not trust whoever runs the ledger.

- A silo holds the receipts its answers came with. It checks that each is signed by the key it
  pinned, that each entry is still in the log with the content that was signed (the leaf recomputed
  from the record the API serves now), and that the current head extends the newest head it holds.
- An auditor holds the last head it verified. It checks that the current head extends it, that the
  leaves the log serves make the signed root, and that every silo's entries state the ε that
  dp-accounting composes from their charges' mechanisms (never from the stored running sums).

Two validly signed heads of one size with different roots are a proof of misbehaviour: it is
printed as JSON that anyone holding the public key can check. Exit
codes as `dpledger verify`: 0 all checks hold, 1 misbehaviour found, 2 could not ask.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from dpledger.service import people_cli
from dpledger.wire import merkle
from dpledger.wire.receipts import (
    ConsistencyProof,
    HeadError,
    InclusionProof,
    LogLeaf,
    PublicKey,
    Receipt,
    SignedTreeHead,
    check_receipt,
    default_receipts_dir,
    key_id,
    record_leaf_hash,
    verify_head,
)

_DEFAULT_RECEIPTS = Path()  # `--receipts` given without DIR: read at run time, when the environment is final
Get = Callable[[str, dict[str, Any] | None], Any]  # path, query → the JSON body; raises on an error status
PAGE = 1000
EPSILON_RTOL = 1e-6  # the ledger's running sum and a fresh sum of the same curves differ by rounding only


class RefusedError(people_cli.CliError):
    """The ledger refused a read (a 4xx status): a finding where a proof was asked for."""


@dataclass
class Outcome:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    evidence: list[dict[str, Any]] = field(default_factory=list)  # proofs of misbehaviour, as printed
    head: SignedTreeHead | None = None  # the current head, once verified

    @property
    def ok(self) -> bool:
        return not self.problems

    def fork(self, a: SignedTreeHead, b: SignedTreeHead, public_key: bytes, why: str) -> None:
        self.problems.append(why)
        self.evidence.append({"misbehaviour": why, "public_key": public_key.hex(),
                              "heads": [a.model_dump(), b.model_dump()]})


def _hex(values: list[str]) -> list[bytes]:
    return [bytes.fromhex(v) for v in values]


def check_extends(get: Get, held: SignedTreeHead, current: SignedTreeHead, public_key: bytes, out: Outcome) -> None:
    """The current head extends `held` (both already verified under `public_key`), or the evidence why not."""
    if current.tree_size < held.tree_size:
        # Found, but not a proof for third parties: the ledger signs past sizes' heads on request too.
        # Once the log regrows past the held size, the same rewrite is a fork, which is one.
        out.problems.append(f"the log shrank from {held.tree_size} to {current.tree_size} leaves: entries were removed")
        return
    if current.tree_size == held.tree_size:
        if current.root_hash != held.root_hash:
            out.fork(held, current, public_key, f"FORK: two signed heads of size {held.tree_size} with different roots")
        return
    proof = ConsistencyProof(**get("/v1/log/proofs/consistency", {"first": held.tree_size, "second": current.tree_size}))
    try:
        merkle.verify_consistency(first=held.tree_size, second=current.tree_size, first_root=bytes.fromhex(held.root_hash),
                                  second_root=bytes.fromhex(current.root_hash), path=_hex(proof.path))
        return
    except merkle.ProofError as error:
        reason = str(error)
    # Ask the ledger to sign its head at the size held: a different root is a fork anyone can check.
    past = SignedTreeHead(**get("/v1/log/head", {"size": held.tree_size}))
    try:
        verify_head(past, public_key)
    except HeadError as error:
        out.problems.append(f"the head the ledger signed for size {held.tree_size} does not verify: {error}")
        return
    if past.root_hash != held.root_hash:
        out.fork(held, past, public_key, f"FORK: two signed heads of size {held.tree_size} with different roots "
                                         "(the log before it was rewritten, and after)")
    else:
        out.problems.append(f"the current head (size {current.tree_size}) is not consistent with the head of size "
                            f"{held.tree_size} held: {reason}")


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


def verify_receipts(get: Get, receipts: list[Receipt], *, public_key: str | None = None) -> Outcome:
    """A silo's check of the receipts it holds (see the module's docstring)."""
    out = Outcome()
    if not receipts:
        out.problems.append("no receipts to check")
        return out
    key_ids = sorted({r.tree_head.key_id for r in receipts})
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
    for r in held:
        earlier = by_size.setdefault(r.tree_head.tree_size, r.tree_head)
        if earlier.root_hash != r.tree_head.root_hash:
            out.fork(earlier, r.tree_head, key, f"FORK: two signed heads of size {earlier.tree_size} with different roots")
    current = current_head(get, key, out)
    if current is None or not held:
        return out
    newest = max((r.tree_head for r in held), key=lambda h: h.tree_size)
    check_extends(get, newest, current, key, out)
    for r in held:
        _check_held_entry(get, r, current, out)
    out.notes.append(f"{len(held)} receipts against the head of size {current.tree_size}")
    return out


def _check_held_entry(get: Get, r: Receipt, current: SignedTreeHead, out: Outcome) -> None:
    name = f"silo {r.silo_id} entry {r.seq} (log index {r.log_index})"
    if r.log_index >= current.tree_size:
        out.problems.append(f"{name}: the log has only {current.tree_size} leaves now")
        return
    served = [LogLeaf(**leaf) for leaf in get("/v1/log/leaves", {"start": r.log_index, "limit": 1})]
    if not served or served[0].log_index != r.log_index:
        out.problems.append(f"{name}: the log serves no leaf at that index")
        return
    leaf = served[0]
    if leaf.record is None:
        out.problems.append(f"{name}: the leaf at that index is no longer this silo's entry")
        return
    entry = json.loads(leaf.record)["entry"]
    if (entry["silo_id"], entry["seq"]) != (r.silo_id, r.seq):
        out.problems.append(f"{name}: the leaf at that index is now silo {entry['silo_id']} entry {entry['seq']}")
    if record_leaf_hash(leaf.record) != r.leaf_hash:
        out.problems.append(f"{name}: the entry now reads differently from what the ledger signed "
                            f"(its record hashes to {record_leaf_hash(leaf.record)[:16]}…, the receipt says {r.leaf_hash[:16]}…)")
    try:
        proof = InclusionProof(**get("/v1/log/proofs/inclusion", {"index": r.log_index, "size": current.tree_size}))
        merkle.verify_inclusion(index=r.log_index, size=current.tree_size, leaf=bytes.fromhex(r.leaf_hash),
                                path=_hex(proof.path), root_hash=bytes.fromhex(current.root_hash))
    except RefusedError as error:
        out.problems.append(f"{name}: the ledger refused its inclusion proof: {error}")
    except merkle.ProofError as error:
        out.problems.append(f"{name}: the signed leaf is not in the current log: {error}")


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
    records = _check_leaves(get, head, out)
    if records is not None:
        _check_compositions(records, out)
    out.notes.append(f"head of size {head.tree_size}, root {head.root_hash[:16]}…")
    return out


def _check_leaves(get: Get, head: SignedTreeHead, out: Outcome) -> list[dict[str, Any]] | None:
    leaves: list[LogLeaf] = []
    while len(leaves) < head.tree_size:
        page = [LogLeaf(**leaf) for leaf in get("/v1/log/leaves", {"start": len(leaves), "limit": PAGE})]
        if not page:
            break
        leaves += page
    leaves = leaves[:head.tree_size]
    if [leaf.log_index for leaf in leaves] != list(range(head.tree_size)):
        out.problems.append(f"the log serves {len(leaves)} leaves, not the {head.tree_size} its head signs")
        return None
    if merkle.root(_hex([leaf.leaf_hash for leaf in leaves])).hex() != head.root_hash:
        out.problems.append("the leaves the log serves do not make the root its head signs")
    records = []
    for leaf in leaves:
        if leaf.record is None:
            out.problems.append(f"log index {leaf.log_index}: no entry behind the leaf (it was deleted)")
            continue
        if record_leaf_hash(leaf.record) != leaf.leaf_hash:
            out.problems.append(f"log index {leaf.log_index}: the entry no longer matches its leaf (edited after it was logged)")
        records.append(json.loads(leaf.record))
    return records


def _check_compositions(records: list[dict[str, Any]], out: Outcome) -> None:
    """Replays each silo's entries: the chain links, and the ε each entry states against the RDP
    composition of the mechanisms of the charges reserved and not released, read as the gate reads
    it: through the silo's filter (its create or filter entry), or its plan's ε once it declared one."""
    from dpledger.service.accounting import filter as rdp_filter
    from dpledger.service.accounting import plans, rdp
    from dpledger.service.accounting.running_sum import RunningSum, curve_from_json
    from dpledger.wire.mechanisms import Mechanism

    adapter: TypeAdapter[Any] = TypeAdapter(Mechanism)
    by_silo: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_silo[record["entry"]["silo_id"]].append(record)
    for silo_id, silo_records in sorted(by_silo.items()):
        silo_records.sort(key=lambda r: r["entry"]["seq"])
        delta: float | None = None
        spec: rdp_filter.FilterSpec | None = None  # none: a silo from before filters, gated on dp-accounting's ε
        plan: plans.Plan | None = None
        live: dict[int, np.ndarray] = {}
        total = RunningSum.empty(len(rdp.ORDERS))  # added and subtracted as the ledger does: O(orders) an entry
        prev_hash, seq = "0" * 64, 0
        for record in silo_records:
            entry, subject = record["entry"], record["subject"]
            name = f"silo {silo_id} entry {entry['seq']}"
            if entry["seq"] != seq + 1 or entry["prev_hash"] != prev_hash:
                out.problems.append(f"{name} does not follow entry {seq} of its chain")
            prev_hash, seq = entry["hash"], entry["seq"]
            if entry["event"] == "create":
                delta = subject["delta"]
                spec = rdp_filter.FilterSpec.from_json(subject["filter"]) if "filter" in subject else None
                continue
            if entry["event"] == "filter":
                spec = rdp_filter.FilterSpec.from_json(subject["filter"])
            elif entry["event"] == "plan":
                plan = plans.Plan.from_json(subject["plan"])
            if delta is None:
                out.problems.append(f"{name}: the silo's create entry is missing")
                return
            charge_id = entry["charge_id"]
            if entry["event"] == "reserve":
                try:
                    mechanism = adapter.validate_json(subject["mechanism"])
                except (ValidationError, ValueError) as error:
                    out.problems.append(f"{name}: charge {charge_id}'s mechanism does not parse: {error}")
                    continue
                stored = curve_from_json(subject["rdp"])
                # Today's charges store the certified curve; charges from before it, dp-accounting's.
                matches = [c for c in (rdp.certified_curve(mechanism), rdp.rdp_curve(mechanism))
                           if c.shape == stored.shape and np.allclose(stored, c, rtol=1e-9, equal_nan=False)]
                if not matches:
                    out.problems.append(f"{name}: charge {charge_id}'s stored RDP curve is not its mechanism's")
                curve = matches[0] if matches else rdp.certified_curve(mechanism)
                live[charge_id] = curve
                total = total.add(curve)
            elif entry["event"] == "release" and charge_id in live:
                total = total.subtract(live.pop(charge_id))
            running = total.curve()
            if plan is not None:
                composed = 0.0 if not np.any(running) else plan.epsilon
            elif spec is not None:
                composed = rdp_filter.read(spec, running, delta=delta).epsilon
            else:
                composed, _ = rdp.epsilon(running, delta=delta)
            stated = math.inf if entry["epsilon_spent"] is None else entry["epsilon_spent"]
            if not (math.isinf(composed) and math.isinf(stated)) and not math.isclose(composed, stated, rel_tol=EPSILON_RTOL):
                out.problems.append(f"{name} ({entry['event']} of charge {charge_id}) states ε={stated:.6g}, "
                                    f"but its charges' mechanisms compose to ε={composed:.6g}")


# --- the commands ---------------------------------------------------------------------------------

def http_get(path: str, params: dict[str, Any] | None) -> Any:
    try:
        return people_cli._get(path, params).json()
    except people_cli.CliError as error:
        if str(error).startswith(("403", "HTTP 4")):
            raise RefusedError(str(error)) from None
        raise


def load_receipts(path: Path) -> list[Receipt]:
    if not path.exists():
        raise people_cli.CliError(f"no receipts at {path}: the trainer's client keeps them in $DPLEDGER_RECEIPTS")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise people_cli.CliError(f"no receipts (*.jsonl) in {path}")
    receipts = []
    for file in files:
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip():
                try:
                    receipts.append(Receipt.model_validate_json(line))
                except ValidationError as error:
                    raise people_cli.CliError(f"{file}:{number} is not a receipt: {error.errors()[0]['msg']}") from None
    return receipts


def report(out: Outcome) -> int:
    for evidence in out.evidence:
        print("PROOF OF MISBEHAVIOUR (two heads signed by the ledger's key that cannot both be honest):")
        print(json.dumps(evidence, indent=2))
    for note in out.notes:
        print(f"ok: {note}" if out.ok else f"note: {note}")
    if out.ok:
        return 0
    print(f"BROKEN: {len(out.problems)} problem(s)")
    for problem in out.problems:
        print(f"  - {problem}")
    return people_cli.EXIT_BROKEN


@people_cli._reports_errors
def verify_receipts_command(args: argparse.Namespace) -> int:
    receipts = load_receipts(default_receipts_dir() if args.receipts is _DEFAULT_RECEIPTS else args.receipts)
    if args.silo is not None:
        receipts = [r for r in receipts if r.silo_id == args.silo]
    return report(verify_receipts(_guarded(http_get), receipts, public_key=args.public_key))


@people_cli._reports_errors
def audit_command(args: argparse.Namespace) -> int:
    try:
        held = json.loads(args.since.read_text()) if args.since.exists() else None
        if held is not None:
            SignedTreeHead.model_validate(held["head"])
            bytes.fromhex(held["public_key"])
    except (ValueError, KeyError, TypeError) as error:  # json's and pydantic's errors are ValueErrors
        raise people_cli.CliError(f"{args.since} is not a head file that `dpledger audit` wrote: {error}") from None
    out = audit(_guarded(http_get), held)
    code = report(out)
    if out.ok and out.head is not None:
        key = held["public_key"] if held is not None else PublicKey(**http_get("/v1/log/public-key", None)).public_key
        args.since.write_text(json.dumps({"public_key": key, "head": out.head.model_dump()}, indent=2) + "\n")
        print(f"saved the head of size {out.head.tree_size} to {args.since}")
        try:
            people_cli._post("/v1/log/verified", out.head.model_dump())
        except people_cli.CliError as error:  # the record on the dashboard is a courtesy, the file is the proof
            print(f"note: the ledger did not record this verification: {error}")
    return code


@people_cli._reports_errors
def pubkey_command(args: argparse.Namespace) -> int:
    key = PublicKey(**http_get("/v1/log/public-key", None))
    print(json.dumps(key.model_dump(), indent=2) if args.json else f"{key.algorithm} {key.public_key}  key id {key.key_id}")
    return 0


def _guarded(get: Get) -> Get:
    def guarded(path: str, params: dict[str, Any] | None) -> Any:
        try:
            return get(path, params)
        except (ValidationError, TypeError) as error:  # a body that is not what the API documents
            raise people_cli.CliError(f"{path} answered something that is not its documented shape: {error}") from None

    return guarded


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser], verify: argparse.ArgumentParser) -> None:
    verify.add_argument("--receipts", type=Path, metavar="DIR", nargs="?", const=_DEFAULT_RECEIPTS,
                        help="check the receipts in DIR (*.jsonl, as the trainer's client keeps them) against the log; "
                        "DIR defaults to where the client keeps them ($DPLEDGER_RECEIPTS, else ~/.local/share/dpledger/receipts)")
    verify.add_argument("--silo", type=int, metavar="ID", help="with --receipts: only this silo's receipts")
    verify.add_argument("--public-key", metavar="HEX", help="with --receipts: the ledger's key, pinned out of band")
    auditing = commands.add_parser(
        "audit", help="check the log against the last head you saw, and every silo's ε against its charges",
        description="Reads DPLEDGER_URL and DPLEDGER_KEY (an auditor's or admin's key).",
    )
    auditing.add_argument("--since", type=Path, required=True, metavar="HEAD_FILE",
                          help="the head this party last verified (created on first use; replaced when all checks hold)")
    auditing.set_defaults(run=audit_command)
    pubkey = commands.add_parser("pubkey", help="print the Ed25519 key that signs the log's tree heads")
    pubkey.add_argument("--json", action="store_true")
    pubkey.set_defaults(run=pubkey_command)
