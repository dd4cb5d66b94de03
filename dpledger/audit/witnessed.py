"""`dpledger verify --receipts --witness URL=VKEY … --require-witnesses K`: a silo's receipts checked
against what independent witnesses cosigned, so that an operator who shows this silo one log and
everyone else another is caught unless the witnesses collude too.

For each witness it fetches the cosigned checkpoint (`dpledger witness` serves GET /checkpoint),
verifies the log's signature (the ledger's key, pinned by the receipts, under the ledger's origin)
and the witness's cosignature/v1 (the witness's key, pinned here), and then checks, with the
ledger's proofs, that the ledger's current log extends the witnessed checkpoint, that every head
the receipts hold is consistent with it, and that every receipt's entry below the witnessed size is
in it. It says which witness cosigned what, and when. Fewer than K witnesses vouching for a log
consistent with the receipts is a failure (exit 1); a witnessed checkpoint that the ledger's own
signed head at that size contradicts is printed as a proof of misbehaviour.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from dpledger.audit import held, transparency
from dpledger.audit.outcome import Outcome
from dpledger.people import terminal
from dpledger.wire import merkle, note
from dpledger.wire.log_proofs import MAX_PROOFS, LogProofs
from dpledger.wire.note import NoteError, SignedCheckpoint, VerifierKey
from dpledger.wire.receipts import HeadError, LogLeaf, PublicKey, Receipt, SignedTreeHead, verify_head
from dpledger.witness.cosigner import FetchError, LedgerLog

WITNESS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WitnessSpec:
    url: str
    key: VerifierKey  # as a cosigner (0x04)

    @property
    def label(self) -> str:
        return f"{self.key.name}+{self.key.key_id:08x}"


def parse_witness(text: str) -> WitnessSpec:
    """`URL=VKEY`: the first '=' after which a verifier key parses (a URL may hold '=' itself)."""
    for at in (i for i, c in enumerate(text) if c == "="):
        try:
            key = VerifierKey.parse(text[at + 1:])
        except NoteError:
            continue
        url = text[:at]
        if url.startswith(("http://", "https://")):
            return WitnessSpec(url.rstrip("/") if url.endswith("/checkpoint") else url.rstrip("/") + "/checkpoint",
                               key.as_cosigner())
    raise argparse.ArgumentTypeError(f"not URL=VERIFIERKEY (a witness's URL and its key <name>+<id>+<key>): {text[:80]!r}")


def _when(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _leaf_indices(ledger: LedgerLog, receipts: list[Receipt]) -> dict[int, str]:
    """Log index → leaf hash of every receipt's entry that is in the log (a promise-only receipt is
    found by its leaf among its silo's leaves)."""
    found = {r.log_index: r.leaf_hash for r in receipts if r.log_index is not None}
    wanted = {r.leaf_hash for r in receipts if r.log_index is None}
    for silo_id in sorted({r.silo_id for r in receipts if r.log_index is None}):
        start = 0
        while wanted:
            page = [LogLeaf(**row) for row in ledger.json("/v1/log/leaves", {"silo_id": silo_id, "start": start,
                                                                              "limit": transparency.SILO_PAGE})]
            for leaf in page:
                if leaf.leaf_hash in wanted:
                    found[leaf.log_index] = leaf.leaf_hash
                    wanted.discard(leaf.leaf_hash)
            if len(page) < transparency.SILO_PAGE:
                break
            start = page[-1].log_index + 1
    return found


def _proofs(ledger: LedgerLog, size: int, *, inclusion: Sequence[int] = (), consistency: Sequence[int] = ()) -> LogProofs:
    """Proofs against the tree of `size` leaves, asked MAX_PROOFS at a time."""
    merged = LogProofs(tree_size=size, inclusion=[], consistency=[])
    for i in range(0, max(len(inclusion), len(consistency), 1), MAX_PROOFS):
        part = LogProofs(**ledger.json("/v1/log/proofs", {
            "size": size, "inclusion": ",".join(map(str, inclusion[i:i + MAX_PROOFS])),
            "consistency": ",".join(map(str, consistency[i:i + MAX_PROOFS]))}))
        merged.inclusion += part.inclusion
        merged.consistency += part.consistency
    return merged


def _consistent(first: int, first_root: bytes, second: int, second_root: bytes, path: list[str]) -> str | None:
    try:
        merkle.verify_consistency(first=first, second=second, first_root=first_root, second_root=second_root,
                                  path=[bytes.fromhex(p) for p in path])
        return None
    except merkle.ProofError as error:
        return str(error)


class _Check:
    def __init__(self, ledger: LedgerLog, receipts: list[Receipt], public_key: str | None, out: Outcome) -> None:
        self.ledger, self.out = ledger, out
        held_ids = {k.key_id for r in receipts for k in (r.promise, r.tree_head) if k is not None}
        served = PublicKey(**ledger.json("/v1/log/public-key"))
        self.public_key = bytes.fromhex(public_key or served.public_key)
        if public_key is None and served.key_id not in held_ids:
            raise _Stop(f"the ledger now signs with key {served.key_id[:16]}…, not the key of the receipts held")
        current = ledger.checkpoint()
        self.log_key = VerifierKey(current.split("\n", 1)[0], note.ED25519, self.public_key)
        try:
            self.current = note.open_checkpoint(current, self.log_key)
        except NoteError as error:
            raise _Stop(f"the ledger's checkpoint does not verify under its key: {error}") from None
        self.heads: dict[int, SignedTreeHead] = {}
        for r in receipts:
            if r.tree_head is not None:
                try:
                    verify_head(r.tree_head, self.public_key)
                    self.heads.setdefault(r.tree_head.tree_size, r.tree_head)
                except HeadError:
                    pass  # `verify --receipts` reports it; a head not signed by the key vouches for nothing
        self.leaves = _leaf_indices(ledger, receipts)

    def witness(self, spec: WitnessSpec) -> bool | None:
        """Whether `spec`'s witness vouches for a log consistent with the receipts (None: it could not
        be asked); says why not."""
        try:
            answer = httpx.get(spec.url, timeout=WITNESS_TIMEOUT_S)
            answer.raise_for_status()
        except httpx.HTTPError as error:
            self.out.notes.append(f"witness {spec.label} at {spec.url} could not be asked: {error}")
            return None
        try:
            seen = note.open_checkpoint(answer.text, self.log_key, also=[spec.key])
        except NoteError as error:
            self.out.notes.append(f"witness {spec.label} at {spec.url} vouches for nothing here: {error}")
            return False
        cosignature = seen.opened.by(spec.key)
        if cosignature is None:
            self.out.notes.append(f"witness {spec.label}: {spec.url} serves a checkpoint it did not cosign")
            return False
        size, root, now = seen.checkpoint.size, seen.checkpoint.root_hash, self.current.checkpoint
        said = (f"witness {spec.label} cosigned size {size} root {root.hex()} at time {cosignature.timestamp} "
                f"({_when(cosignature.timestamp)})")
        if size > now.size:
            self._evidence(spec, seen, {"current_checkpoint": self.current.text},
                           f"ROLLBACK: {said}, but the ledger's checkpoint now has {now.size} leaves")
            return False
        held = sorted(n for n in self.heads if n <= now.size)
        extended = _proofs(self.ledger, now.size, consistency=[size, *held])
        reason = _consistent(size, root, now.size, now.root_hash, extended.consistency[0].path)
        if reason is not None:
            past = SignedTreeHead(**self.ledger.json("/v1/log/head", {"size": size}))
            verify_head(past, self.public_key)
            why = "the ledger's log does not extend it" if past.root_hash == root.hex() else \
                f"the ledger's key signs a head of size {size} with root {past.root_hash} today"
            self._evidence(spec, seen, {"ledger_head": past.model_dump(), "consistency_proof": extended.consistency[0].path},
                           f"FORK: {said}; {why} ({reason})")
            return False
        for n, extends in zip(held, extended.consistency[1:], strict=True):
            head = self.heads[n]
            if _consistent(n, bytes.fromhex(head.root_hash), now.size, now.root_hash, extends.path) is not None:
                self.out.problems.append(f"{said}, but the head of size {n} held does not lead to the log it extends")
                return False
        below = sorted(i for i in self.leaves if i < size)
        for proof in _proofs(self.ledger, size, inclusion=below).inclusion if below else []:
            try:
                merkle.verify_inclusion(index=proof.log_index, size=size, leaf=bytes.fromhex(self.leaves[proof.log_index]),
                                        path=[bytes.fromhex(p) for p in proof.path], root_hash=root)
            except merkle.ProofError as error:
                self.out.problems.append(f"{said}, but the receipt's entry at log index {proof.log_index} is not in it: {error}")
                return False
        heads = f", and {sum(1 for n in held if n <= size)} of the {len(held)} heads held" if held else ""
        self.out.notes.append(f"{said}: the ledger's log of size {now.size} extends it; {len(below)} of the "
                              f"{len(self.leaves)} receipted entries in the log{heads} lie in it")
        return True

    def _evidence(self, spec: WitnessSpec, seen: SignedCheckpoint, more: dict[str, Any], why: str) -> None:
        self.out.problems.append(why)
        self.out.evidence.append({"misbehaviour": why, "log_key": self.log_key.encode(), "public_key": self.public_key.hex(),
                                  "witness_key": spec.key.encode(), "witnessed_checkpoint": seen.text, **more})


class _Stop(Exception):
    pass


def check_witnesses(ledger: LedgerLog, receipts: list[Receipt], witnesses: list[WitnessSpec], *, require: int,
                    public_key: str | None = None) -> Outcome:
    out = Outcome()
    try:
        check = _Check(ledger, receipts, public_key, out)
    except _Stop as stop:
        out.problems.append(str(stop))
        return out
    answers = {spec.label: check.witness(spec) for spec in witnesses}
    vouching = [label for label, vouched in answers.items() if vouched]
    unasked = [label for label, vouched in answers.items() if vouched is None]
    if len(vouching) < require:
        said = (f"{len(vouching)} of the {require} witnesses required vouch for a log consistent with the "
                f"receipts ({', '.join(vouching) or 'none'})")
        if len(vouching) + len(unasked) >= require:  # the ones not reached might have: could not ask, not a finding
            out.unasked.append(f"{said}; {', '.join(unasked)} could not be reached")
        else:
            out.problems.append(said)
    return out


def report(out: Outcome) -> int:
    return transparency.report(
        out, of=" with the witnesses",
        proof=lambda _: "a checkpoint the ledger's key signed and a witness cosigned, against what the ledger's key "
        "signs today",
    )


@terminal.reports_errors
def verify_witnesses_command(args: argparse.Namespace) -> int:
    if args.require_witnesses > len(args.witness):
        raise terminal.CliError(f"--require-witnesses {args.require_witnesses} with {len(args.witness)} --witness given")
    folder = held.receipts_folder(args.receipts)
    # The receipts the check above read: this ledger's, this key's (it said why it left others aside).
    receipts = held.select(transparency.guarded(transparency.http_get), folder, public_key=args.public_key,
                           silo=args.silo, holder=terminal.ledger_key()).receipts
    if not receipts:
        return 0
    ledger = LedgerLog(terminal.ledger_url(), terminal.ledger_key())
    try:
        return report(check_witnesses(ledger, receipts, args.witness, require=args.require_witnesses,
                                      public_key=args.public_key))
    except (FetchError, httpx.HTTPError, ValidationError, HeadError, KeyError) as error:
        raise terminal.CliError(f"could not check the witnesses against the ledger: {error}") from None
    finally:
        ledger.close()


def combined(receipts_code: int, witnesses_code: int) -> int:
    """A finding (1) wins over could-not-ask (2), which wins over ok (0)."""
    codes = {receipts_code, witnesses_code}
    return terminal.EXIT_BROKEN if terminal.EXIT_BROKEN in codes else max(codes)


def add_arguments(verify: argparse.ArgumentParser) -> None:
    verify.add_argument("--witness", type=parse_witness, action="append", default=[], metavar="URL=VKEY",
                        help="with --receipts: a witness's cosigned checkpoint URL and its verifier key (repeatable)")
    verify.add_argument("--require-witnesses", type=int, default=0, metavar="K",
                        help="with --receipts: fail unless K of the --witness vouch for a log consistent with the receipts")
