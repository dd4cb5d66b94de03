"""The transparency log's tables: pending leaves, leaves, nodes, the state row, signed and verified heads.

The log's logic (ledger/transparency.py: the records, Merkle math, promises and proofs) decides what
to write and read; the statements are here, each a function of the caller's session, returning plain
values, Core rows or ORM objects. The statements an approval and a sequencer batch run are built
once, at import, and run as Core (executemany for a batch): the ORM's bulk path and an IN list built
from literals cost the sequencer about a third of its time. A list of indices or ids is asked for in
IN lists of CHUNK, inside every database's limit on bound parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Row, Table, and_, bindparam, delete, insert, select, update
from sqlalchemy.orm import Session

from dpledger.service.store import compiled
from dpledger.service.store.models import (
    Charge,
    LedgerEntry,
    LogHead,
    LogLeaf,
    LogNode,
    LogPending,
    LogState,
    Silo,
    VerifiedHead,
)
from dpledger.wire.receipts import SignedTreeHead

STATE_ID = 1  # the id of the log's one state row
CHUNK = 500  # rows asked per IN list: inside every database's limit on bound parameters

_INSERT_PENDING = insert(cast(Table, LogPending.__table__))  # every approval: built once
# A batch's statements, built once and run as Core executemany: the ORM's bulk path and an IN list
# built from literals cost the sequencer about a third of its time.
_PENDING = cast(Table, LogPending.__table__)
_INSERT_LEAVES = insert(cast(Table, LogLeaf.__table__))
_INSERT_NODES = insert(cast(Table, LogNode.__table__))
_DELETE_PENDING = delete(_PENDING).where(_PENDING.c.id.in_(bindparam("ids", expanding=True)))
_STATE = cast(Table, LogState.__table__)
_LOCK_STATE = select(_STATE.c.size, _STATE.c.frontier).where(_STATE.c.id == STATE_ID).with_for_update()
_NEXT_PENDING = select(_PENDING.c.id, _PENDING.c.entry_id, _PENDING.c.salt, _PENDING.c.leaf_hash,
                       _PENDING.c.promised_by).order_by(_PENDING.c.id).limit(bindparam("limit"))
_UPDATE_STATE = update(_STATE).where(_STATE.c.id == STATE_ID)
_INSERT_HEAD = insert(cast(Table, LogHead.__table__))


# --- an approval -------------------------------------------------------------------------------

def insert_pending(session: Session, row: dict[str, Any] | list[dict[str, Any]]) -> None:
    """`log_pending` rows (entry_id, salt, leaf_hash, promised_by), in the caller's transaction: one
    (an approval's, on the driver's cursor: store/compiled.py), or a list as one executemany. Not the
    ORM's bulk path: nothing reads them back in this transaction."""
    if isinstance(row, dict):
        compiled.run(session, _INSERT_PENDING, row)
    else:
        session.connection().execute(_INSERT_PENDING, row)


# --- the sequencer -----------------------------------------------------------------------------

def any_pending(session: Session) -> bool:
    """Whether a leaf waits for its index: the sequencer's idle look, with no write lock taken."""
    return session.scalars(select(LogPending.id).limit(1)).first() is not None


def lock_state(session: Session) -> tuple[int, str]:
    """The state row's (size, frontier JSON), locked (`FOR UPDATE`) for the rest of the transaction:
    one sequencer at a time even if two were started by hand."""
    size, frontier = session.connection().execute(_LOCK_STATE).one()
    return size, frontier


def next_pending(session: Session, limit: int) -> Sequence[Row[int, int, str, str, int]]:
    """Up to `limit` pending rows (id, entry_id, salt, leaf_hash, promised_by), in `id` order."""
    return session.connection().execute(_NEXT_PENDING, {"limit": limit}).all()


def store_batch(session: Session, *, leaves: list[dict[str, Any]], nodes: list[dict[str, Any]],
                sequenced: list[int], size: int, frontier: str) -> None:
    """A batch's writes, in this order: its leaf rows, the node rows it completed (if any), the
    deletion of its pending rows (`sequenced`: their ids), and the state row's new size and frontier."""
    connection = session.connection()
    connection.execute(_INSERT_LEAVES, leaves)
    if nodes:
        connection.execute(_INSERT_NODES, nodes)
    connection.execute(_DELETE_PENDING, {"ids": sequenced})
    connection.execute(_UPDATE_STATE, {"size": size, "frontier": frontier})


def store_head(session: Session, *, size: int, root: str, head: SignedTreeHead) -> None:
    """The head signed over the batch's tree of `size` leaves and root `root`."""
    session.connection().execute(_INSERT_HEAD, {"tree_size": size, "root_hash": root, "timestamp": head.timestamp,
                                                "key_id": head.key_id, "signature": head.signature})


# --- an append at once (migrations from before the sequencer) ----------------------------------

def state(session: Session, *, for_update: bool = False) -> tuple[int, str]:
    """The state row's (size, frontier JSON), through the session (`for_update`: locked). Core
    columns, not the ORM's object: an ORM copy of the row in this session could be stale."""
    statement = select(LogState.size, LogState.frontier).where(LogState.id == STATE_ID)
    size, frontier = session.execute(statement.with_for_update() if for_update else statement).one()
    return size, frontier


def add_leaf(session: Session, *, idx: int, entry_id: int, salt: str, leaf_hash: str) -> None:
    session.execute(insert(LogLeaf).values(idx=idx, entry_id=entry_id, salt=salt, leaf_hash=leaf_hash))


def add_nodes(session: Session, rows: list[dict[str, Any]]) -> None:
    """Node rows (level, idx, hash)."""
    session.execute(insert(LogNode), rows)


def set_state(session: Session, *, size: int, frontier: str) -> None:
    session.execute(update(LogState).where(LogState.id == STATE_ID).values(size=size, frontier=frontier))


# --- proofs ------------------------------------------------------------------------------------

def leaf_hashes(session: Session, indices: list[int]) -> list[tuple[int, str]]:
    """(idx, leaf_hash) of the leaves at `indices` that exist, a query per CHUNK of them."""
    found: list[tuple[int, str]] = []
    for i in range(0, len(indices), CHUNK):
        chunk = indices[i:i + CHUNK]
        found += ((idx, digest) for idx, digest in
                  session.execute(select(LogLeaf.idx, LogLeaf.leaf_hash).where(LogLeaf.idx.in_(chunk))))
    return found


def node_hashes(session: Session, level: int, indices: list[int]) -> list[tuple[int, str]]:
    """(idx, hash) of the stored nodes of `level` at `indices` that exist, a query per CHUNK of them."""
    found: list[tuple[int, str]] = []
    for i in range(0, len(indices), CHUNK):
        condition = and_(LogNode.level == level, LogNode.idx.in_(indices[i:i + CHUNK]))
        found += ((idx, digest) for idx, digest in session.execute(select(LogNode.idx, LogNode.hash).where(condition)))
    return found


def first_head_over(session: Session, index: int) -> LogHead | None:
    """The smallest signed head that includes leaf `index` (the head of its batch), if any."""
    return session.execute(select(LogHead).where(LogHead.tree_size > index).order_by(LogHead.tree_size).limit(1)
                           ).scalars().one_or_none()


# --- leaves ------------------------------------------------------------------------------------

def leaves_at(session: Session, indices: list[int]) -> list[LogLeaf]:
    """The leaf rows at these indices (any missing is left out)."""
    rows: list[LogLeaf] = []
    unique = sorted(set(indices))
    for i in range(0, len(unique), CHUNK):
        rows += session.scalars(select(LogLeaf).where(LogLeaf.idx.in_(unique[i:i + CHUNK])))
    return rows


def silo_leaves(session: Session, silo_id: int, *, start: int, limit: int) -> list[LogLeaf]:
    """The leaves of one silo's entries from index `start`, in log order."""
    return list(session.scalars(
        select(LogLeaf).join(LedgerEntry, LedgerEntry.id == LogLeaf.entry_id)
        .where(LedgerEntry.silo_id == silo_id, LogLeaf.idx >= start).order_by(LogLeaf.idx).limit(limit)
    ))


def leaves(session: Session, *, start: int, limit: int) -> list[LogLeaf]:
    """A page of the log from index `start`. Core rows with the leaf's columns (read-only, the
    attributes of a LogLeaf): an audit reads the log in pages of 10,000."""
    found = session.connection().execute(
        select(*LogLeaf.__table__.columns).where(LogLeaf.idx >= start).order_by(LogLeaf.idx).limit(limit))
    return cast(list[LogLeaf], list(found))


def pending_of(session: Session, entry_id: int) -> Row[str, int] | None:
    """The entry's pending leaf (leaf_hash, promised_by), or None."""
    return session.execute(select(LogPending.leaf_hash, LogPending.promised_by)
                           .where(LogPending.entry_id == entry_id)).one_or_none()


def sequenced_of(session: Session, entry_id: int) -> Row[int, str, int | None] | None:
    """The entry's sequenced leaf (idx, leaf_hash, promised_by), or None."""
    return session.execute(select(LogLeaf.idx, LogLeaf.leaf_hash, LogLeaf.promised_by)
                           .where(LogLeaf.entry_id == entry_id)).one_or_none()


def leaf_by_hash(session: Session, leaf_hash: str) -> LogLeaf | None:
    return session.scalars(select(LogLeaf).where(LogLeaf.leaf_hash == leaf_hash).limit(1)).one_or_none()


def is_pending(session: Session, leaf_hash: str) -> bool:
    return session.scalars(select(LogPending.id).where(LogPending.leaf_hash == leaf_hash).limit(1)).first() is not None


# --- what the leaves commit to -----------------------------------------------------------------

def entries_and_charges(session: Session, rows: Sequence[LogLeaf]) -> tuple[dict[int, Any], dict[int, Any]]:
    """The entries behind these (non-empty) leaves and their charges, by id: Core rows with the
    columns of LedgerEntry and of Charge (its curve's text as `rdp`), not ORM objects (they carry the
    same attributes, which is all a record reads): building two ORM instances per leaf was most of
    the time of a 10,000-leaf page. Two reads whatever the page's length; a silo's leaves spread over
    the log, a read per CHUNK of ids."""
    low, high = min(r.idx for r in rows), max(r.idx for r in rows)
    # A charge's curve is its text in the curves table, read through its key (store/curves.py).
    entry_columns, charge_columns = LedgerEntry.__table__.columns, (*Charge.__table__.columns, Charge.rdp.label("rdp"))
    if high - low < 2 * len(rows):  # a page of the log: a range of the index, no list of ids to bind
        in_page = LogLeaf.idx.between(low, high)
        # On the session's connection: Core rows without the ORM's loading pass over 10,000 of them.
        connection = session.connection()
        entry_rows = connection.execute(select(*entry_columns).join(LogLeaf, LogLeaf.entry_id == LedgerEntry.id).where(in_page))
        charge_rows = connection.execute(select(*charge_columns).join(LedgerEntry, LedgerEntry.charge_id == Charge.id)
                                         .join(LogLeaf, LogLeaf.entry_id == LedgerEntry.id).where(in_page))
        entries = {e.id: e for e in entry_rows}
        charges = {c.id: c for c in charge_rows}
    else:  # one silo's leaves, spread over the log
        ids = [r.entry_id for r in rows]
        entries = {e.id: e for i in range(0, len(ids), CHUNK)
                   for e in session.execute(select(*entry_columns).where(LedgerEntry.id.in_(ids[i:i + CHUNK])))}
        charge_ids = sorted({e.charge_id for e in entries.values() if e.charge_id is not None})
        charges = {c.id: c for i in range(0, len(charge_ids), CHUNK)
                   for c in session.execute(select(*charge_columns).where(Charge.id.in_(charge_ids[i:i + CHUNK])))}
    return entries, charges


def silos(session: Session, ids: set[int]) -> dict[int, Silo]:
    """The silos of these ids, by id (no read for none)."""
    return {s.id: s for s in session.scalars(select(Silo).where(Silo.id.in_(ids)))} if ids else {}


# --- auditors' heads ---------------------------------------------------------------------------

def last_verified(session: Session) -> VerifiedHead | None:
    """The head an auditor verified last."""
    return session.scalars(select(VerifiedHead).order_by(VerifiedHead.id.desc()).limit(1)).one_or_none()
