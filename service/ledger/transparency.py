"""The transparency log over every ledger entry (RFC 9162, Certificate Transparency's design).

Each silo's hash chain finds a careless edit, but whoever operates the database can rewrite a chain
and recompute every hash. So every entry, of every silo, is also a leaf of one append-only Merkle
tree whose heads the service signs (`signer.py`): a silo that holds a receipt, or an auditor that
holds an earlier head, can then prove any rewrite, cut or fork (the tests in
tests/service/test_transparency.py do each by SQL).

Costs, per append (inside the entry's own transaction, after the silo's lock): one locked read of
the `log_state` row, one leaf row, on average one `log_nodes` row (the subtrees the leaf completes),
the state's update, O(1) amortised hashes; the new root and the new leaf's inclusion path come from
the frontier in memory (O(log n) hashes), so a receipt costs no read of the tree. A proof for any
other entry or size reads O(log n) rows in two queries. The `log_state` lock is the one place where
all silos' approvals meet: on PostgreSQL, approvals of different silos, which used to commit side
by side, now queue for it from their append to their commit.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import and_, insert, select, update
from sqlalchemy.orm import Session

from dpledger.service.ledger import chain
from dpledger.service.ledger.errors import Conflict, InvalidRequest, NotFound
from dpledger.service.ledger.models import Charge, LedgerEntry, LogLeaf, LogNode, LogState, Silo, VerifiedHead
from dpledger.wire import merkle
from dpledger.wire.enums import EntryEvent
from dpledger.wire.receipts import SignedTreeHead

STATE_ID = 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Position:
    """Where an entry sits in the log, and the tree (size, root) with the path that proves it."""

    silo_id: int
    seq: int
    log_index: int
    leaf_hash: str
    tree_size: int
    root_hash: str
    path: list[str]
    timestamp: int  # ms since the epoch: when the entry was appended, and so when the tree had tree_size leaves


def leaf_record(entry: Any, *, subject: dict[str, Any], salt: str) -> str:
    """The bytes a leaf commits to: the entry, what its chain hash covers, and a random salt.
    Recomputed from the live rows whenever it is served, so an edit of any of them changes it.
    Never change this encoding: stored leaf hashes depend on it (a new one would be "v": 2)."""
    epsilon = entry.epsilon_spent
    body = {
        "v": 1,
        "salt": salt,
        "entry": {
            "silo_id": entry.silo_id,
            "seq": entry.seq,
            "event": str(getattr(entry.event, "value", entry.event)),
            "charge_id": entry.charge_id,
            # JSON has no infinity: an infinite ε is null, as on the rest of the API.
            "epsilon_spent": epsilon if math.isfinite(epsilon) else None,
            "created_at": chain.timestamp(entry.created_at),
            "prev_hash": entry.prev_hash,
            "hash": entry.hash,
        },
        "subject": subject,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def new_salt() -> str:
    return os.urandom(16).hex()


def append(session: Session, entry: LedgerEntry, *, subject: dict[str, Any]) -> Position:
    """Appends `entry` (flushed, so it has an id) as the log's next leaf. The caller's transaction
    holds the entry's silo lock; this takes the log's own lock, always second."""
    # Core statements, not the ORM's unit of work: this runs in every approval, under two locks.
    size, stored = session.execute(
        select(LogState.size, LogState.frontier).where(LogState.id == STATE_ID).with_for_update()
    ).one()
    salt = new_salt()
    leaf = merkle.leaf_hash(leaf_record(entry, subject=subject, salt=salt).encode())
    index = size
    frontier, completed, path = merkle.append([bytes.fromhex(h) for h in json.loads(stored)], index, leaf)
    session.execute(insert(LogLeaf).values(idx=index, entry_id=entry.id, salt=salt, leaf_hash=leaf.hex()))
    if completed:
        session.execute(insert(LogNode), [
            {"level": width.bit_length() - 1, "idx": start // width, "hash": digest.hex()} for start, width, digest in completed
        ])
    session.execute(update(LogState).where(LogState.id == STATE_ID).values(
        size=index + 1, frontier=json.dumps([h.hex() for h in frontier])
    ))
    return Position(entry.silo_id, entry.seq, index, leaf.hex(), index + 1, merkle.frontier_root(frontier).hex(),
                    [p.hex() for p in path], milliseconds(entry.created_at))


def milliseconds(moment: datetime) -> int:
    # SQLite hands datetimes back naive (they are UTC); integer arithmetic, so a re-read row gives the same.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return (aware - _EPOCH) // timedelta(milliseconds=1)


def size_and_root(session: Session) -> tuple[int, str]:
    # Core, like `append`'s update: an ORM copy of the row in this session could be stale.
    size, frontier = session.execute(select(LogState.size, LogState.frontier).where(LogState.id == STATE_ID)).one()
    return size, merkle.frontier_root([bytes.fromhex(h) for h in json.loads(frontier)]).hex()


def _subtrees(session: Session, build: Callable[[merkle.Subtree], Any]) -> Any:
    """Runs `build` over stored subtree hashes, fetched in two queries (leaves, inner nodes)."""
    return _subtrees_many(session, [build])[0]


_CHUNK = 500  # rows asked per IN list: inside every database's limit on bound parameters


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
    for i in range(0, len(leaves), _CHUNK):
        chunk = leaves[i:i + _CHUNK]
        for idx, digest in session.execute(select(LogLeaf.idx, LogLeaf.leaf_hash).where(LogLeaf.idx.in_(chunk))):
            found[(idx, 1)] = bytes.fromhex(digest)
    for level, indices in nodes.items():
        for i in range(0, len(indices), _CHUNK):
            condition = and_(LogNode.level == level, LogNode.idx.in_(indices[i:i + _CHUNK]))
            for idx, digest in session.execute(select(LogNode.idx, LogNode.hash).where(condition)):
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
    rows: list[LogLeaf] = []
    unique = sorted(set(indices))
    for i in range(0, len(unique), _CHUNK):
        rows += session.scalars(select(LogLeaf).where(LogLeaf.idx.in_(unique[i:i + _CHUNK])))
    return rows


def silo_leaves(session: Session, silo_id: int, *, start: int, limit: int) -> list[LogLeaf]:
    """The leaves of one silo's entries, in log order (a silo checks its own without paging the log)."""
    return list(session.scalars(
        select(LogLeaf).join(LedgerEntry, LedgerEntry.id == LogLeaf.entry_id)
        .where(LedgerEntry.silo_id == silo_id, LogLeaf.idx >= start).order_by(LogLeaf.idx).limit(limit)
    ))


def position_of(session: Session, entry: LedgerEntry) -> Position:
    """An earlier entry's place in the log, in the tree just after it: the same receipt as the first
    answer's (Ed25519 signatures are deterministic), so a replayed request answers the first answer."""
    row = session.scalars(select(LogLeaf).where(LogLeaf.entry_id == entry.id)).one_or_none()
    if row is None:
        raise NotFound(f"entry {entry.seq} of silo {entry.silo_id} is not in the transparency log")
    size, root = root_at(session, row.idx + 1)
    _, path = inclusion(session, row.idx, size)
    return Position(entry.silo_id, entry.seq, row.idx, row.leaf_hash, size, root, path, milliseconds(entry.created_at))


def record_of(session: Session, row: LogLeaf) -> tuple[LedgerEntry | None, str | None]:
    """The leaf's entry and its record as the live rows say now (None if the entry is gone)."""
    return records_of(session, [row])[0]


def records_of(session: Session, rows: list[LogLeaf]) -> list[tuple[LedgerEntry | None, str | None]]:
    """`record_of` for a page of leaves, in three reads whatever its length. Core rows, not ORM
    objects (they carry the same attributes, which is all a record reads): building two ORM instances
    per leaf was most of the time of a 10,000-leaf page."""
    if not rows:
        return []
    low, high = min(r.idx for r in rows), max(r.idx for r in rows)
    entry_columns, charge_columns = LedgerEntry.__table__.columns, Charge.__table__.columns
    if high - low < 2 * len(rows):  # a page of the log: a range of the index, no list of ids to bind
        in_page = LogLeaf.idx.between(low, high)
        entry_rows = session.execute(select(*entry_columns).join(LogLeaf, LogLeaf.entry_id == LedgerEntry.id).where(in_page))
        charge_rows = session.execute(select(*charge_columns).join(LedgerEntry, LedgerEntry.charge_id == Charge.id)
                                      .join(LogLeaf, LogLeaf.entry_id == LedgerEntry.id).where(in_page))
        entries = {e.id: e for e in entry_rows}
        charges = {c.id: c for c in charge_rows}
    else:  # one silo's leaves, spread over the log
        ids = [r.entry_id for r in rows]
        entries = {e.id: e for i in range(0, len(ids), _CHUNK)
                   for e in session.execute(select(*entry_columns).where(LedgerEntry.id.in_(ids[i:i + _CHUNK])))}
        charge_ids = sorted({e.charge_id for e in entries.values() if e.charge_id is not None})
        charges = {c.id: c for i in range(0, len(charge_ids), _CHUNK)
                   for c in session.execute(select(*charge_columns).where(Charge.id.in_(charge_ids[i:i + _CHUNK])))}
    silo_ids = {e.silo_id for e in entries.values() if e.charge_id is None}
    silos = {s.id: s for s in session.scalars(select(Silo).where(Silo.id.in_(silo_ids)))} if silo_ids else {}
    out: list[tuple[LedgerEntry | None, str | None]] = []
    for row in rows:
        entry = entries.get(row.entry_id)
        if entry is None:
            out.append((None, None))
            continue
        if entry.charge_id is None:
            silo = silos.get(entry.silo_id)
            subject = {} if silo is None else _silo_subject(cast(LedgerEntry, entry), silo)
        else:
            charge = charges.get(entry.charge_id)
            subject = {} if charge is None else chain.charge_fields(cast(Charge, charge))  # a row of its columns
        out.append((cast(LedgerEntry, entry), leaf_record(entry, subject=subject, salt=row.salt)))
    return out


def _silo_subject(entry: LedgerEntry, silo: Silo) -> dict[str, Any]:
    """What a charge-less entry covers: its create, filter, plan or seal subject (chain.subject)."""
    try:
        event = EntryEvent(entry.event)
    except ValueError:  # an edited event: recomputed as a create, so the leaf no longer matches
        event = EntryEvent.create
    if event not in (EntryEvent.create, EntryEvent.filter, EntryEvent.plan, EntryEvent.seal):
        event = EntryEvent.create
    return chain.subject(event, silo, None)


def leaves(session: Session, *, start: int, limit: int) -> list[LogLeaf]:
    # Core rows with the leaf's columns (read-only here): an audit reads the log in pages of 10,000.
    found = session.execute(select(*LogLeaf.__table__.columns).where(LogLeaf.idx >= start).order_by(LogLeaf.idx).limit(limit))
    return cast(list[LogLeaf], list(found))


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
    last = session.scalars(select(VerifiedHead).order_by(VerifiedHead.id.desc()).limit(1)).one_or_none()
    extends = None
    if last is not None:
        try:
            extends = last.tree_size <= size and root_at(session, last.tree_size)[1] == last.root_hash
        except NotFound:  # a stored subtree is gone: the log was cut
            extends = False
    return LogSummary(size, root, last, extends)
