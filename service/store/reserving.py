"""The approval's storage contract: what a reservation reads under its lock and what it appends.

A reservation is check-then-append in one write transaction (ledger/charges.py):
1. `Reserving.lock`: the silo row locked, the caller's key read live in the same statement (share-locked
   on PostgreSQL, so a revocation waits for this transaction), and on PostgreSQL the id a new charge
   takes;
2. `covering_entries`: the entries that cover the silo's record and those past the chain's end this
   process replayed (ledger/seals.py checks them), with the charge the idempotency key already names,
   read in that statement *after* the lock's: a PostgreSQL statement that waited for the lock reads
   everything but the locked row as it was when it started, and would miss a retry of the same key
   that committed meanwhile (READ COMMITTED); the next statement sees it. Exactly-once rests on this
   order, so the read is asked for only with the lock in hand (`AfterLock`), nowhere earlier on the
   write path;
3. `Reserving.insert_charge`, then `Reserving.append`: the charge, the chain's entry (whose hash names
   the charge's id), its pending leaf of the transparency log and the silo's new columns.

Each database implements the three steps that differ (`sqlite.SqliteReserving`,
`postgres.PostgresReserving`); `of(session)` picks the one for the session's database. The statements
both run as written are here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sqlalchemy import ColumnElement, CompoundSelect, Row, Select, Table, Update, bindparam, insert, select, union_all, update
from sqlalchemy.orm import Session

from dpledger.service.store import compiled, log
from dpledger.service.store.models import SILO_COLUMNS, ApiKey, Charge, Curve, LedgerEntry, Silo, SiloRecord

_ENTRIES = cast(Table, LedgerEntry.__table__)
_CHARGES = cast(Table, Charge.__table__)
_CURVES = cast(Table, Curve.__table__)
_KEYS = cast(Table, ApiKey.__table__)

# The charge's columns an entry's hash covers (chain.charge_fields), read with the entry: "rdp" is its
# curve's text, read through "curve_hash" from the curves table (store/curves.py).
CHARGE_COLUMNS = ("id", "silo_id", "idempotency_key", "request_hash", "mechanism", "curve_hash", "rdp", "order_grid",
                  "conversion", "status", "job_id", "round", "epsilon_spent_after", "created_at", "touched_at",
                  "attempt_id")
# An entry's own columns, as an approval writes them.
ENTRY_COLUMNS = ("silo_id", "seq", "event", "charge_id", "epsilon_spent", "created_at", "prev_hash", "hash")
# A record is covered by at most four entries (its create or seal entry, its filter entry, its retire
# entry, its plan entry); the list is fixed, not expanding (which would be rendered again at each
# execution), and a shorter one repeats its first.
COVERING_AT_MOST = 4
PAGE = 2000  # entries a cold replay reads at a time

# Every approval runs these: built once, so an execution skips building and keying a statement.
INSERT_CHARGE = insert(_CHARGES).returning(_CHARGES.c.id)
CHARGE_BY_KEY = select(_CHARGES.c.id).where(
    _CHARGES.c.silo_id == bindparam("silo_id"), _CHARGES.c.idempotency_key == bindparam("idempotency_key")
)
# The key `key_id` if it is live.
LIVE_KEY = select(_KEYS.c.id).where(_KEYS.c.id == bindparam("key_id"), _KEYS.c.revoked_at.is_(None))
_SILOS = cast(Table, Silo.__table__)
# A reservation's lock in one statement: the silo locked (its columns, SILO_COLUMNS, then), and the
# caller's key live. Read on the cursor (compiled.rows) into a SiloRecord, not loaded by the ORM.
LOCK_AND_KEY = select(
    *(_SILOS.c[name] for name in SILO_COLUMNS), LIVE_KEY.with_for_update(read=True).scalar_subquery().label("key_live"),
).where(_SILOS.c.id == bindparam("silo_id")).with_for_update(of=_SILOS)
LOCK_SILO = select(Silo).where(Silo.id == bindparam("silo_id")).with_for_update()
_REVOKED_AT = select(_KEYS.c.revoked_at).where(_KEYS.c.id == bindparam("key_id")).with_for_update(read=True)


@functools.cache
def store_statement(columns: tuple[str, ...]) -> Update:
    """UPDATE of these columns of one silo (`new_<column>`): one per set of columns an entry writes (its
    chain fields, and a running sum or none), a handful."""
    return update(_SILOS).where(_SILOS.c.id == bindparam("silo_id")).values(
        {column: bindparam(f"new_{column}") for column in columns}
    )


def store_columns(session: Session, silo_id: int, columns: dict[str, Any]) -> None:
    compiled.run(session, store_statement(tuple(columns)), {"silo_id": silo_id, **{f"new_{k}": v for k, v in columns.items()}})


def _entries(where: ColumnElement[bool]) -> Select[Any]:
    """The silo's entries where `where` holds, each with the charge it names (`c_*`: what its hash covers,
    its curve's text read through its key)."""
    columns = (_CURVES.c.rdp if name == "rdp" else _CHARGES.c[name] for name in CHARGE_COLUMNS)
    return select(*_ENTRIES.c, *(column.label(f"c_{name}") for name, column in zip(
        CHARGE_COLUMNS, columns, strict=True))).select_from(
        _ENTRIES.outerjoin(_CHARGES, _CHARGES.c.id == _ENTRIES.c.charge_id)
        .outerjoin(_CURVES, _CURVES.c.hash == _CHARGES.c.curve_hash)
    ).where(_ENTRIES.c.silo_id == bindparam("silo_id"), where)


# Every load runs it: the entries that cover the record, and those past `since` (the end of the chain
# this process replayed; none where it holds the record's own end). A UNION ALL of two index ranges,
# where an OR of them would scan the silo's whole chain on SQLite.
_COVERING = _entries(_ENTRIES.c.seq.in_([bindparam(f"seq{i}") for i in range(COVERING_AT_MOST)]))
_AFTER = _entries(_ENTRIES.c.seq > bindparam("since"))
_PAGE_AFTER = _AFTER.order_by(_ENTRIES.c.seq).limit(PAGE)
_EARLIER = CHARGE_BY_KEY.scalar_subquery().label("earlier")


@functools.cache
def _covering_statement(with_key: bool) -> CompoundSelect[Any]:
    if not with_key:
        return union_all(_COVERING, _AFTER)
    return union_all(_COVERING.add_columns(_EARLIER), _AFTER.add_columns(_EARLIER))


def covering_entries(
    session: Session, *, silo_id: int, seqs: Sequence[int], since: int, key: AfterLock | None = None,
) -> tuple[Sequence[Any], int | None]:
    """The silo's entries at `seqs` (at most COVERING_AT_MOST) and after `since`, each with its charge's
    columns (named tuples, compiled.rows: this runs at every approval); and, given `key`, the id of
    the silo's charge under its idempotency key, read in the same statement (None where there is
    none, or where no entry was read)."""
    assert 0 < len(seqs) <= COVERING_AT_MOST
    assert key is None or key.locked.silo.id == silo_id, "the key's charge is read under its own silo's lock"
    with_key = key is not None
    rows = compiled.rows(session, _covering_statement(with_key), {
        "silo_id": silo_id, "since": since, **({"idempotency_key": key.idempotency_key} if key is not None else {}),
        **{f"seq{i}": seqs[min(i, len(seqs) - 1)] for i in range(COVERING_AT_MOST)},
    })
    earlier = rows[0][-1] if with_key and rows else None
    return rows, earlier


def entries_after(session: Session, *, silo_id: int, since: int) -> Sequence[Row[Any]]:
    """Up to PAGE of the silo's entries after `since`, in chain order, each with its charge's columns."""
    return session.connection().execute(_PAGE_AFTER, {"silo_id": silo_id, "since": since}).all()


def charge_by_key(session: Session, *, silo_id: int, idempotency_key: str) -> int | None:
    """The id of the silo's charge under this idempotency key (one read of the unique index)."""
    found = session.connection().execute(
        CHARGE_BY_KEY, {"silo_id": silo_id, "idempotency_key": idempotency_key}
    ).scalar_one_or_none()
    return None if found is None else int(found)


def key_live(session: Session, key_id: int) -> bool:
    """Whether the key exists and is not revoked, share-locking its row on PostgreSQL (a revocation
    then waits for this transaction; SQLite's write lock already orders them)."""
    found = session.connection().execute(_REVOKED_AT, {"key_id": key_id}).one_or_none()
    return found is not None and found.revoked_at is None


def lock_silo(session: Session, silo_id: int) -> Silo | None:
    """The silo row, locked until the transaction ends (FOR UPDATE; SQLite's IMMEDIATE lock already
    serialises writers)."""
    return session.scalars(LOCK_SILO, {"silo_id": silo_id}).one_or_none()


@dataclass(frozen=True)
class Locked:
    """What a reservation's lock read: the silo (locked), whether the caller's key is live (True where
    none was asked), and the id a new charge takes where the database hands it out before the insert."""

    silo: SiloRecord
    key_live: bool
    next_id: int | None

    @classmethod
    def of(cls, row: Sequence[Any], *, key_id: int | None, next_id: int | None = None) -> Locked:
        """From a row of LOCK_AND_KEY (and the columns a database adds after it)."""
        columns = len(SILO_COLUMNS)
        return cls(SiloRecord(*row[:columns]), key_id is None or row[columns] is not None, next_id)


@dataclass(frozen=True)
class AfterLock:
    """An idempotency key whose charge is to be read with the covering entries, and the lock held when it
    is: the only way to ask for that read (module docstring, step 2: it must come after the lock's
    statement, or a retry that committed while the lock was awaited goes unseen)."""

    locked: Locked
    idempotency_key: str


@dataclass(frozen=True)
class NewCharge:
    """A charge given its id: written already, or (`row`) still to be written by `append`, with its
    curve (`curve`: key and text) where that is to be written too."""

    id: int
    row: dict[str, Any] | None
    curve: tuple[str, str] | None


@dataclass(frozen=True)
class Appended:
    """One entry of a silo's chain as `append` writes it: the silo's new columns, the entry's columns
    (ENTRY_COLUMNS), its pending leaf's (salt, leaf_hash, promised_by), and the charge it writes first."""

    silo_id: int
    columns: dict[str, Any]
    entry: dict[str, Any]
    leaf: dict[str, Any]
    charge: NewCharge | None = None


class Reserving(Protocol):
    """One database's statements of the approval path."""

    def lock(self, session: Session, *, silo_id: int, key_id: int | None) -> Locked | None:
        """The silo locked with the key's liveness read (None: no such silo)."""

    def insert_charge(self, session: Session, values: dict[str, Any], *, locked: Locked,
                      curve: tuple[str, str] | None) -> NewCharge:
        """The charge `values` given its id; `curve` (key, text): its curve's row, to write first."""

    def append(self, session: Session, appended: Appended) -> None:
        """Writes the entry, its pending leaf, the silo's columns and any charge still to write."""

    def next_ids(self, session: Session, table: Table, count: int) -> list[int]:
        """The ids the next `count` inserts into `table` get (`append_many` inserts under them); the
        caller holds the write lock."""


_INSERT_MANY_CHARGES = insert(_CHARGES)
_INSERT_MANY_ENTRIES = insert(_ENTRIES)


def append_many(session: Session, *, silo_id: int, columns: dict[str, Any], charges: list[dict[str, Any]],
                entries: list[dict[str, Any]], leaves: list[dict[str, Any]]) -> None:
    """A batch of charges and their entries appended at once, as a loop of approvals would write them
    (bulk seeding, bench/_seeding.py, which checks the two equal): the charges before the entries that
    name them (foreign keys), the entries under the ids `Reserving.next_ids` gave, their pending leaves
    (`entry_id`, salt, leaf_hash, promised_by), then the silo's columns once. Curves are written apart
    (store/curves.py `store`). One executemany a table."""
    connection = session.connection()
    connection.execute(_INSERT_MANY_CHARGES, charges)
    connection.execute(_INSERT_MANY_ENTRIES, entries)
    log.insert_pending(session, leaves)
    store_columns(session, silo_id, columns)


def of(session: Session) -> Reserving:
    """The implementation for the database `session` is bound to."""
    from dpledger.service.store import postgres, sqlite

    return postgres.RESERVING if session.connection().dialect.name == "postgresql" else sqlite.RESERVING
