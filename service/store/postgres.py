"""PostgreSQL's side of the approval (store/reserving.py): a statement costs a round trip, about
0.1 ms of the server's CPU, so the approval's writes share statements.

- The lock's statement also takes the id a new charge will have from the charges' sequence, so the
  charge can be inserted in its entry's statement (the entry's hash names the id). A lock that approves
  nothing leaves a gap in the ids, as a rolled-back insert does.
- `append` writes the silo's new columns, the entry and its pending leaf (and the charge, and before it
  the charge's curve where this process does not know it stored) in one statement of data-modifying
  CTEs. The charge's foreign key to its curve is checked at the statement's end, when the curve's CTE
  has run.
- The key's row is share-locked by the lock's statement (FOR SHARE), so a revocation waits for the
  reservation's transaction, which then happened before it."""

from __future__ import annotations

import functools
from typing import Any, cast

from sqlalchemy import BigInteger, Insert, Table, bindparam, func, insert, literal_column, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from dpledger.service.store import compiled
from dpledger.service.store.models import Charge, Curve, LedgerEntry, LogPending
from dpledger.service.store.reserving import (
    ENTRY_COLUMNS,
    LOCK_AND_KEY,
    Appended,
    Locked,
    NewCharge,
    store_statement,
)

_CURVES = cast(Table, Curve.__table__)
_ENTRIES = cast(Table, LedgerEntry.__table__)
_CHARGES = cast(Table, Charge.__table__)
_PENDING = cast(Table, LogPending.__table__)
_LEAF_COLUMNS = ("salt", "leaf_hash", "promised_by")
# One curve row (`curve_hash`, `curve_rdp`) that does nothing where the key is stored already.
INSERT_CURVE = postgresql.insert(_CURVES).values(
    {"hash": bindparam("curve_hash", type_=_CURVES.c.hash.type), "rdp": bindparam("curve_rdp", type_=_CURVES.c.rdp.type)}
).on_conflict_do_nothing(index_elements=["hash"])
# The sequence's name written into the SQL (compiled.rows binds only what the caller names).
_LOCK_WITH_NEXT_ID = LOCK_AND_KEY.add_columns(
    literal_column(f"nextval(pg_get_serial_sequence('{_CHARGES.name}', 'id'))", BigInteger).label("next_id"))


@functools.cache
def _append_statement(columns: tuple[str, ...], *, with_charge: bool, with_curve: bool) -> Insert:
    stored = store_statement(columns).cte("stored")
    ctes = [stored]
    if with_charge:
        ctes.insert(0, insert(_CHARGES).values(
            {column.name: bindparam(f"charge_{column.name}", type_=column.type) for column in _CHARGES.c}
        ).cte("charge"))
    if with_curve:
        ctes.insert(0, INSERT_CURVE.cte("curve"))
    entry = insert(_ENTRIES).values(
        {column: bindparam(f"entry_{column}", type_=_ENTRIES.c[column].type) for column in ENTRY_COLUMNS}
    ).returning(_ENTRIES.c.id).cte("entry")
    leaf = select(entry.c.id, *(bindparam(column, type_=_PENDING.c[column].type) for column in _LEAF_COLUMNS))
    return insert(_PENDING).from_select(["entry_id", *_LEAF_COLUMNS], leaf).add_cte(*ctes)


class PostgresReserving:
    def lock(self, session: Session, *, silo_id: int, key_id: int | None) -> Locked | None:
        found = compiled.rows(session, _LOCK_WITH_NEXT_ID, {"silo_id": silo_id, "key_id": key_id})
        return Locked.of(found[0], key_id=key_id, next_id=int(found[0][-1])) if found else None

    def insert_charge(self, session: Session, values: dict[str, Any], *, locked: Locked,
                      curve: tuple[str, str] | None) -> NewCharge:
        assert locked.next_id is not None
        return NewCharge(locked.next_id, {"id": locked.next_id, **values}, curve)

    def append(self, session: Session, appended: Appended) -> None:
        charge, columns = appended.charge, appended.columns
        row = None if charge is None else charge.row
        curve = charge.curve if charge is not None and row is not None else None
        statement = _append_statement(tuple(columns), with_charge=row is not None, with_curve=curve is not None)
        compiled.run(session, statement, {
            "silo_id": appended.silo_id, **{f"new_{k}": v for k, v in columns.items()},
            **{f"entry_{column}": value for column, value in appended.entry.items()}, **appended.leaf,
            **{f"charge_{column}": value for column, value in (row or {}).items()},
            **({} if curve is None else {"curve_hash": curve[0], "curve_rdp": curve[1]}),
        })


    def next_ids(self, session: Session, table: Table, count: int) -> list[int]:
        # The serial's next values: other writers may take ids meanwhile, never these.
        rows = session.scalars(select(func.nextval(func.pg_get_serial_sequence(table.name, "id")))
                               .select_from(func.generate_series(1, count)))
        return sorted(int(r) for r in rows)


RESERVING = PostgresReserving()
