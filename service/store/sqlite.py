"""SQLite's side of the approval (store/reserving.py): a statement runs in-process, so the charge,
the entry and its leaf are separate statements that cost little; the charge's id comes back from its
INSERT … RETURNING, before the entry whose hash names it.

SQLite has one writer at a time (store/db.py takes its write lock up front, BEGIN IMMEDIATE), so the
lock's FOR UPDATE renders as nothing and the key's share lock is the write lock itself."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, bindparam, func, insert, select
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from dpledger.service.store import compiled, log
from dpledger.service.store.models import Curve, LedgerEntry
from dpledger.service.store.reserving import INSERT_CHARGE, LOCK_AND_KEY, Appended, Locked, NewCharge, store_columns

_CURVES = cast(Table, Curve.__table__)
_ENTRIES = cast(Table, LedgerEntry.__table__)
# One curve row (`curve_hash`, `curve_rdp`) that does nothing where the key is stored already.
INSERT_CURVE = sqlite.insert(_CURVES).values(
    {"hash": bindparam("curve_hash", type_=_CURVES.c.hash.type), "rdp": bindparam("curve_rdp", type_=_CURVES.c.rdp.type)}
).on_conflict_do_nothing(index_elements=["hash"])
_INSERT_ENTRY = insert(_ENTRIES).returning(_ENTRIES.c.id)


class SqliteReserving:
    def lock(self, session: Session, *, silo_id: int, key_id: int | None) -> Locked | None:
        found = compiled.rows(session, LOCK_AND_KEY, {"silo_id": silo_id, "key_id": key_id})
        return Locked.of(found[0], key_id=key_id) if found else None

    def insert_charge(self, session: Session, values: dict[str, Any], *, locked: Locked,
                      curve: tuple[str, str] | None) -> NewCharge:
        if curve is not None:
            compiled.run(session, INSERT_CURVE, {"curve_hash": curve[0], "curve_rdp": curve[1]})
        return NewCharge(int(compiled.run(session, INSERT_CHARGE, values)), None, None)

    def append(self, session: Session, appended: Appended) -> None:
        assert appended.charge is None or appended.charge.row is None, "SQLite writes a charge before its entry"
        store_columns(session, appended.silo_id, appended.columns)
        entry_id = compiled.run(session, _INSERT_ENTRY, appended.entry)
        log.insert_pending(session, {"entry_id": entry_id, **appended.leaf})


    def next_ids(self, session: Session, table: Table, count: int) -> list[int]:
        # max + 1 onwards: the caller holds SQLite's one write lock, so nobody else inserts meanwhile.
        start = int(session.scalar(select(func.max(table.c.id))) or 0) + 1
        return list(range(start, start + count))


RESERVING = SqliteReserving()
