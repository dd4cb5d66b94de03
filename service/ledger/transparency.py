"""The transparency log over every ledger entry (RFC 9162, Certificate Transparency's design).

Each silo's hash chain finds a careless edit, but whoever operates the database can rewrite a chain
and recompute every hash. So every entry, of every silo, is also a leaf of one append-only Merkle
tree whose heads the service signs (`signer.py`): a silo that holds a receipt, or an auditor that
holds an earlier head, can then prove any rewrite, cut or fork (the tests in
tests/service/test_transparency.py do each by SQL).

Two steps, as production logs do it (Trillian's sequencer, Sigstore's Rekor, CT's merge delay):
- `pending_leaf`, inside the approval's own transaction (after the silo's lock): the leaf's hash and
  salt, written with the entry as one `log_pending` row (store/reserving.py `append`). No row is
  shared by silos, so approvals of different silos commit side by side; the receipt carries the
  log key's signed promise that the leaf is in the log by a deadline (`MERGE_DELAY_MS` after the entry).
- `sequence`, run by the one elected sequencer of the database (sequencer.py) 0.1–1 s after a ring:
  pending leaves in `id` order get the next log indices, the subtrees they complete are stored
  (`log_nodes`), the `log_state` row (size, frontier) is updated, and one head per batch is signed
  and stored (`log_heads`), all in one transaction: a crash anywhere leaves every leaf either still
  pending or in the log, never neither.

Costs: an approval, one insert and one SHA-256 of its record; a batch of n leaves, O(n) hashes, on
average one node row per leaf, and one signature. A proof for any entry or size reads O(log n) rows in
two queries.

This module holds the log's logic: the leaf records, the Merkle math over them, promises and proofs.
Every statement on the log's tables (and the reads of the entries, charges and silos behind a page of
leaves) is in store/log.py, called with the caller's session.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy.orm import Session

from dpledger.service.ledger import chain
from dpledger.service.ledger.errors import Conflict, InvalidRequest, NotFound
from dpledger.service.store import log
from dpledger.service.store.db import leaf_written
from dpledger.service.store.models import (
    Charge,
    EntryRecord,
    LedgerEntry,
    LogLeaf,
    Silo,
    VerifiedHead,
)
from dpledger.wire import merkle
from dpledger.wire.enums import EntryEvent
from dpledger.wire.receipts import SignedTreeHead

STATE_ID = log.STATE_ID  # the log's one state row (migration 0006 writes it)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# How long after its entry a leaf is promised to be in the log. The sequencer runs 0.1–1 s after an approval;
# the rest is room for a restart (a crashed sequencer's successor is elected within a second or
# two, sequencer.py): a promise broken by a longer outage is evidence against the operator, as it should be.
MERGE_DELAY_MS = 60_000
BATCH = 1000  # leaves per sequencing transaction: a backlog after an outage is drained in bounded steps


@dataclass(frozen=True)
class Inclusion:
    """A sequenced leaf's index, the head it is proven into and the path between them. `head`: the
    head its batch's sequencer signed (None for leaves from before batches: the head just after the
    leaf, stamped with the entry's time, signed when asked, as receipts always were)."""

    log_index: int
    tree_size: int
    root_hash: str
    timestamp: int
    path: list[str]
    head: SignedTreeHead | None


@dataclass(frozen=True)
class Position:
    """An entry's leaf: what its receipt promises (`deadline`, None for leaves from before promises)
    and, once sequenced, where it sits in the log (`included`)."""

    silo_id: int
    seq: int
    leaf_hash: str
    timestamp: int  # ms since the epoch: the entry's time, and the promise's
    deadline: int | None
    included: Inclusion | None


def leaf_record(entry: Any, *, subject: dict[str, Any], salt: str) -> str:
    """The bytes a leaf commits to: the entry, what its chain hash covers, and a random salt.
    Recomputed from the live rows whenever it is served, so an edit of any of them changes it.
    Never change this encoding: stored leaf hashes depend on it (a new one would be "v": 2)."""
    return _record_text(entry, subject_text=canonical(subject), salt=salt)


canonical = chain.canonical


def _record_text(entry: Any, *, subject_text: str, salt: str) -> str:
    """`canonical` of {"v": 1, "salt", "entry", "subject"} with the subject's text given: a page of
    the log encodes each charge's subject (its RDP curve is most of a record) once for its reserve and
    its commit. The keys are written in canonical (sorted) order, as `canonical` writes them."""
    epsilon = entry.epsilon_spent
    fields = {
        "silo_id": entry.silo_id,
        "seq": entry.seq,
        "event": str(getattr(entry.event, "value", entry.event)),
        "charge_id": entry.charge_id,
        # JSON has no infinity: an infinite ε is null, as on the rest of the API.
        "epsilon_spent": epsilon if math.isfinite(epsilon) else None,
        "created_at": chain.timestamp(entry.created_at),
        "prev_hash": entry.prev_hash,
        "hash": entry.hash,
    }
    return f'{{"entry":{canonical(fields)},"salt":{json.dumps(salt)},"subject":{subject_text},"v":1}}'


def new_salt() -> str:
    return os.urandom(16).hex()


def pending_leaf(entry: LedgerEntry | EntryRecord, *, subject_text: str) -> tuple[dict[str, Any], Position]:
    """`entry`'s pending leaf (the row's values but its `entry_id`) and the receipt's position;
    writes nothing. `subject_text`: canonical(what the entry's hash covers), as its chain hash read it.
    The write under way rings the sequencer once it commits (db.leaf_written)."""
    leaf_written()
    salt = new_salt()
    leaf = merkle.leaf_hash(_record_text(entry, subject_text=subject_text, salt=salt).encode()).hex()
    timestamp = milliseconds(entry.created_at)
    deadline = timestamp + MERGE_DELAY_MS  # read at each call: a test shortens it to see a promise broken
    row = {"salt": salt, "leaf_hash": leaf, "promised_by": deadline}
    return row, Position(entry.silo_id, entry.seq, leaf, timestamp, deadline, None)


def sequence(session: Session, sign: Callable[[int, str], SignedTreeHead], *, limit: int = BATCH) -> int:
    """Gives up to `limit` pending leaves, in `id` order, the next log indices, and signs one head
    (`sign(size, root)`) over the tree they end; returns how many. One transaction, the caller's:
    the state row is locked first (one sequencer at a time even if two were started by hand)."""
    size, stored = log.lock_state(session)
    pending = log.next_pending(session, limit)
    if not pending:
        return 0
    frontier = [bytes.fromhex(h) for h in json.loads(stored)]
    leaf_rows, node_rows = [], []
    for offset, row in enumerate(pending):
        index = size + offset
        frontier, completed, _ = merkle.append(frontier, index, bytes.fromhex(row.leaf_hash))
        leaf_rows.append({"idx": index, "entry_id": row.entry_id, "salt": row.salt, "leaf_hash": row.leaf_hash,
                          "promised_by": row.promised_by})
        node_rows += [{"level": w.bit_length() - 1, "idx": start // w, "hash": h.hex()} for start, w, h in completed]
    new_size = size + len(pending)
    root = merkle.frontier_root(frontier).hex()
    log.store_batch(session, leaves=leaf_rows, nodes=node_rows, sequenced=[row.id for row in pending],
                    size=new_size, frontier=json.dumps([h.hex() for h in frontier]))
    head = sign(new_size, root)
    log.store_head(session, size=new_size, root=root, head=head)
    return len(pending)


def append(session: Session, entry: LedgerEntry, *, subject: dict[str, Any]) -> int:
    """Appends `entry` as the log's next leaf at once, under the state row's lock, and returns its
    index. Only for migrations written before the sequencer (0005 appends filter entries to a log
    that has no pending leaves yet); every request enqueues instead."""
    size, stored = log.state(session, for_update=True)
    salt = new_salt()
    leaf = merkle.leaf_hash(leaf_record(entry, subject=subject, salt=salt).encode())
    frontier, completed, _ = merkle.append([bytes.fromhex(h) for h in json.loads(stored)], size, leaf)
    log.add_leaf(session, idx=size, entry_id=entry.id, salt=salt, leaf_hash=leaf.hex())
    if completed:
        log.add_nodes(session, [
            {"level": width.bit_length() - 1, "idx": start // width, "hash": digest.hex()} for start, width, digest in completed
        ])
    log.set_state(session, size=size + 1, frontier=json.dumps([h.hex() for h in frontier]))
    return int(size)


def milliseconds(moment: datetime) -> int:
    # SQLite hands datetimes back naive (they are UTC); integer arithmetic, so a re-read row gives the same.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return (aware - _EPOCH) // timedelta(milliseconds=1)


def size_and_root(session: Session) -> tuple[int, str]:
    # The row's columns, not its ORM object: an ORM copy of the row in this session could be stale.
    size, frontier = log.state(session)
    return size, merkle.frontier_root([bytes.fromhex(h) for h in json.loads(frontier)]).hex()


def _subtrees(session: Session, build: Callable[[merkle.Subtree], Any]) -> Any:
    """Runs `build` over stored subtree hashes, fetched in two queries (leaves, inner nodes)."""
    return _subtrees_many(session, [build])[0]


def _subtrees_many(session: Session, builds: list[Callable[[merkle.Subtree], Any]]) -> list[Any]:
    """Runs each of `builds` over stored subtree hashes, all fetched together: a batch of proofs costs
    a query per few hundred distinct subtrees, not two per proof."""
    wanted = sorted({w for build in builds for w in merkle.needed_subtrees(build)})
    leaves = [start for start, width in wanted if width == 1]
    nodes: dict[int, list[int]] = {}
    for start, width in wanted:
        if width > 1:
            nodes.setdefault(width.bit_length() - 1, []).append(start // width)
    found: dict[tuple[int, int], bytes] = {}
    for idx, digest in log.leaf_hashes(session, leaves):
        found[(idx, 1)] = bytes.fromhex(digest)
    for level, indices in nodes.items():
        for idx, digest in log.node_hashes(session, level, indices):
            found[(idx << level, 1 << level)] = bytes.fromhex(digest)

    def subtree(start: int, width: int) -> bytes:
        digest = found.get((start, width))
        if digest is None:
            # A stored subtree is missing: the log's tables were cut. Say so instead of a 500.
            raise NotFound(f"the log has no stored subtree [{start}, {start + width}): its tables are incomplete")
        return digest

    return [build(subtree) for build in builds]


def _check_size(session: Session, size: int | None) -> int:
    current, _ = size_and_root(session)
    if size is None:
        return current
    if not 0 <= size <= current:
        raise InvalidRequest("size", f"must be in [0, {current}], the log's current size; found {size}")
    return size


def root_at(session: Session, size: int | None = None) -> tuple[int, str]:
    """(size, root) of the log's first `size` leaves (default: all of them)."""
    size = _check_size(session, size)
    current, root = size_and_root(session)
    if size == current:
        return size, root
    if size == 0:
        return 0, merkle.EMPTY_ROOT.hex()
    return size, _subtrees(session, lambda s: merkle.range_hash(0, size, s)).hex()


def leaf(session: Session, index: int) -> LogLeaf:
    row = session.get(LogLeaf, index)
    if row is None:
        raise NotFound(f"log index {index} not found")
    return row


def inclusion(session: Session, index: int, size: int | None = None) -> tuple[int, list[str]]:
    size = _check_size(session, size)
    if not 0 <= index < size:
        raise InvalidRequest("index", f"must be below the tree size {size}; found {index}")
    path = _subtrees(session, lambda s: merkle.inclusion_proof(index, size, s))
    return size, [p.hex() for p in path]


def consistency(session: Session, first: int, second: int | None = None) -> tuple[int, list[str]]:
    second = _check_size(session, second)
    if not 0 <= first <= second:
        raise InvalidRequest("first", f"must be in [0, {second}]; found {first}")
    path = _subtrees(session, lambda s: merkle.consistency_proof(first, second, s))
    return second, [p.hex() for p in path]


def proofs(
    session: Session, *, size: int | None, indices: list[int], firsts: list[int]
) -> tuple[int, list[list[str]], list[list[str]]]:
    """Inclusion proofs of `indices` and consistency proofs from each of `firsts`, all in the tree of
    `size` leaves (default: the current one), from one fetch of the subtrees they need."""
    size = _check_size(session, size)
    for index in indices:
        if not 0 <= index < size:
            raise InvalidRequest("inclusion", f"every index must be below the tree size {size}; found {index}")
    for first in firsts:
        if not 0 <= first <= size:
            raise InvalidRequest("consistency", f"every first size must be in [0, {size}]; found {first}")
    builds: list[Callable[[merkle.Subtree], Any]] = [
        *(lambda s, i=i: merkle.inclusion_proof(i, size, s) for i in indices),
        *(lambda s, f=f: merkle.consistency_proof(f, size, s) for f in firsts),
    ]
    paths = [[p.hex() for p in path] for path in _subtrees_many(session, builds)]
    return size, paths[:len(indices)], paths[len(indices):]


def leaves_at(session: Session, indices: list[int]) -> list[LogLeaf]:
    """The leaf rows at these indices (any missing is left out: `proofs` refuses an index past the size)."""
    return log.leaves_at(session, indices)


def silo_leaves(session: Session, silo_id: int, *, start: int, limit: int) -> list[LogLeaf]:
    """The leaves of one silo's entries, in log order (a silo checks its own without paging the log)."""
    return log.silo_leaves(session, silo_id, start=start, limit=limit)


def position_of(session: Session, entry: LedgerEntry) -> Position:
    """An earlier entry's leaf: its promise, and its place in the log once sequenced, proven into the
    head of its batch. The same receipt on every read (Ed25519 signatures are deterministic), so a
    replayed request answers the first answer's promise, with the inclusion it has gained since."""
    timestamp = milliseconds(entry.created_at)
    # Pending first, then sequenced: the order in which the sequencer moves a leaf (in one
    # transaction), so that a write's READ COMMITTED statements, each on its own snapshot, cannot
    # miss one moved between the two reads.
    waiting = log.pending_of(session, entry.id)
    if waiting is not None:
        return Position(entry.silo_id, entry.seq, waiting.leaf_hash, timestamp, waiting.promised_by, None)
    row = log.sequenced_of(session, entry.id)
    if row is None:
        raise NotFound(f"entry {entry.seq} of silo {entry.silo_id} is not in the transparency log")
    return Position(entry.silo_id, entry.seq, row.leaf_hash, timestamp, row.promised_by,
                    inclusion_in_batch(session, row.idx, timestamp=timestamp))


def inclusion_in_batch(session: Session, index: int, *, timestamp: int) -> Inclusion:
    """Leaf `index` proven into the head its batch's sequencer signed; a leaf from before batches
    (or a log whose heads were cut) into the tree just after it, stamped `timestamp`."""
    current, _ = size_and_root(session)
    head = log.first_head_over(session, index)
    if head is not None and head.tree_size <= current:
        _, path = inclusion(session, index, head.tree_size)
        signed = SignedTreeHead(tree_size=head.tree_size, root_hash=head.root_hash, timestamp=head.timestamp,
                                key_id=head.key_id, signature=head.signature)
        return Inclusion(index, head.tree_size, head.root_hash, head.timestamp, path, signed)
    size, root = root_at(session, index + 1)
    _, path = inclusion(session, index, size)
    return Inclusion(index, size, root, timestamp, path, None)


def index_of_leaf(session: Session, leaf_hash: str) -> LogLeaf | None:
    """The sequenced leaf with this hash (salted: one entry's), or None while it is pending or unknown."""
    return log.leaf_by_hash(session, leaf_hash)


def is_pending(session: Session, leaf_hash: str) -> bool:
    return log.is_pending(session, leaf_hash)


def record_of(session: Session, row: LogLeaf) -> tuple[LedgerEntry | None, str | None]:
    """The leaf's entry and its record as the live rows say now (None if the entry is gone)."""
    return records_of(session, [row])[0]


def records_of(session: Session, rows: list[LogLeaf]) -> list[tuple[LedgerEntry | None, str | None]]:
    """`record_of` for a page of leaves, in three reads whatever its length. Core rows, not ORM
    objects (they carry the same attributes, which is all a record reads): building two ORM instances
    per leaf was most of the time of a 10,000-leaf page (store/log.py `entries_and_charges`)."""
    if not rows:
        return []
    entries, charges = log.entries_and_charges(session, rows)
    silos = log.silos(session, {e.silo_id for e in entries.values() if e.charge_id is None})
    out: list[tuple[LedgerEntry | None, str | None]] = []
    charge_texts: dict[int, str] = {}  # a charge's reserve and commit cover the same subject
    for row in rows:
        entry = entries.get(row.entry_id)
        if entry is None:
            out.append((None, None))
            continue
        if entry.charge_id is None:
            silo = silos.get(entry.silo_id)
            text = canonical({} if silo is None else _silo_subject(cast(LedgerEntry, entry), silo))
        elif entry.charge_id in charge_texts:
            text = charge_texts[entry.charge_id]
        else:
            charge = charges.get(entry.charge_id)
            text = charge_texts[entry.charge_id] = canonical({} if charge is None else chain.charge_fields(cast(Charge, charge)))
        out.append((cast(LedgerEntry, entry), _record_text(entry, subject_text=text, salt=row.salt)))
    return out


def _silo_subject(entry: LedgerEntry, silo: Silo) -> dict[str, Any]:
    """What a charge-less entry covers: its create, filter, plan, seal or retire subject (chain.subject)."""
    try:
        event = EntryEvent(entry.event)
    except ValueError:  # an edited event: recomputed as a create, so the leaf no longer matches
        event = EntryEvent.create
    if event not in (EntryEvent.create, EntryEvent.filter, EntryEvent.plan, EntryEvent.seal, EntryEvent.retire):
        event = EntryEvent.create
    return chain.subject(event, silo, None)


def leaves(session: Session, *, start: int, limit: int) -> list[LogLeaf]:
    # Core rows with the leaf's columns (read-only here): an audit reads the log in pages of 10,000.
    return log.leaves(session, start=start, limit=limit)


def record_verified(session: Session, head: SignedTreeHead, *, api_key_id: int) -> VerifiedHead:
    """Notes that an auditor verified `head` (its signature checked by the caller). A head whose
    root is not this log's at its size is refused: it is evidence, and belongs with the auditor."""
    current, _ = size_and_root(session)
    if head.tree_size > current or root_at(session, head.tree_size)[1] != head.root_hash:
        raise Conflict(f"the head of size {head.tree_size} is not this log's: keep it, it is evidence of a fork")
    row = VerifiedHead(tree_size=head.tree_size, root_hash=head.root_hash, signed_at=head.timestamp, key_id=head.key_id,
                       signature=head.signature, api_key_id=api_key_id, verified_at=datetime.now(UTC))
    session.add(row)
    return row


@dataclass(frozen=True)
class LogSummary:
    size: int
    root_hash: str
    last_verified: VerifiedHead | None
    still_extends: bool | None  # whether today's log still starts with the last verified head


def summary(session: Session) -> LogSummary:
    size, root = size_and_root(session)
    last = log.last_verified(session)
    extends = None
    if last is not None:
        try:
            extends = last.tree_size <= size and root_at(session, last.tree_size)[1] == last.root_hash
        except NotFound:  # a stored subtree is gone: the log was cut
            extends = False
    return LogSummary(size, root, last, extends)
