"""The approval's writes on the driver's cursor (service/store/compiled.py) store what SQLAlchemy's own
execution stores, on SQLite and on PostgreSQL: the same row, byte for byte as the database holds it
(a datetime's text on SQLite, an enum's value), the same errors, and nothing written where a bind would
have needed a column's default."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event, exc, insert, select, text

from dpledger.service.ledger import silos
from dpledger.service.store import compiled, curves, reserving
from dpledger.service.store.db import Database
from dpledger.service.store.models import ChargeStatus, Silo

pytestmark = pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database.connect(database_url)
    yield database
    database.dispose()


def _values(silo_id: int, key: str) -> dict[str, Any]:
    return {
        "silo_id": silo_id, "idempotency_key": key, "request_hash": "r" * 64, "mechanism": '{"type":"dpsgd"}',
        "curve_hash": "c" * 64, "order_grid": "grid", "conversion": "conversion", "status": ChargeStatus.reserved,
        "job_id": None, "round": 7, "epsilon_spent_after": 0.1 + 0.2,
        "created_at": datetime(2026, 11, 30, 8, 0, 1, 123456, tzinfo=UTC), "touched_at": None, "attempt_id": "a-1",
    }


def test_a_compiled_write_stores_what_sqlalchemy_stores(db: Database) -> None:
    silo, _ = silos.register(db, name="compiled", epsilon=5.0, delta=1e-5, dataset_size=1000)
    with db.write() as session:
        dialect = session.connection().dialect.name
        compiled.run(session, curves.INSERT[dialect], {"curve_hash": "c" * 64, "curve_rdp": "[1.0]"})
        by_sqlalchemy = session.connection().execute(reserving.INSERT_CHARGE, _values(silo.id, "k1")).scalar_one()
        by_cursor = compiled.run(session, reserving.INSERT_CHARGE, _values(silo.id, "k2"))
    assert isinstance(by_cursor, int) and by_cursor == by_sqlalchemy + 1  # RETURNING id, as a plain int
    with db.read() as session:
        # As the database holds them (no type's result processing): a datetime's text, an enum's value.
        rows = session.execute(text("SELECT * FROM charges WHERE id IN (:a, :b) ORDER BY id"),
                               {"a": by_sqlalchemy, "b": by_cursor}).mappings().all()
    first, second = ({k: v for k, v in row.items() if k not in ("id", "idempotency_key")} for row in rows)
    assert first == second
    assert [row["idempotency_key"] for row in rows] == ["k1", "k2"]


def test_an_update_and_its_listeners_see_the_statement_once(db: Database) -> None:
    silo, _ = silos.register(db, name="listened", epsilon=5.0, delta=1e-5, dataset_size=1000)
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", note)
    try:
        with db.write() as session:
            reserving.store_columns(session, silo.id, {"plan_used": 3})
    finally:
        event.remove(db.engine, "before_cursor_execute", note)
    assert [s for s in seen if s.lstrip().upper().startswith("UPDATE")] == [
        compiled.compiled(reserving.store_statement(("plan_used",)), db.engine.dialect,
                          frozenset({"silo_id", "new_plan_used"})).sql]
    with db.read() as session:
        assert session.get(Silo, silo.id).plan_used == 3  # type: ignore[union-attr]


def test_a_driver_error_is_sqlalchemys_and_writes_nothing(db: Database) -> None:
    silo, _ = silos.register(db, name="duplicate", epsilon=5.0, delta=1e-5, dataset_size=1000)
    with db.write() as session:
        compiled.run(session, curves.INSERT[session.connection().dialect.name], {"curve_hash": "c" * 64, "curve_rdp": "[1.0]"})
        compiled.run(session, reserving.INSERT_CHARGE, _values(silo.id, "once"))
    with pytest.raises(exc.IntegrityError), db.write() as session:  # the unique (silo, key) index
        compiled.run(session, reserving.INSERT_CHARGE, {**_values(silo.id, "once"), "round": 8})
    with db.read() as session:
        assert session.execute(text("SELECT count(*) FROM charges")).scalar_one() == 1


def test_a_statement_that_needs_a_default_is_refused(db: Database) -> None:
    # silos.chain_seq has a Python-side default (0): SQLAlchemy would bind it, the cursor path cannot.
    statement = insert(Silo.__table__)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="defaults"):
        compiled.compiled(statement, db.engine.dialect, frozenset({"name", "epsilon"}))
    with db.read() as session:
        assert session.scalars(select(Silo)).all() == []


def test_a_read_on_the_cursor_returns_what_sqlalchemy_returns(db: Database) -> None:
    """The covering entries' read (store/reserving.py) as named tuples: every value as SQLAlchemy's own
    execution returns it (an entry's event as its enum, a datetime, a charge's status and its curve's
    text through the join), by position and by each column's key, the charge's columns empty on an
    entry without one, and the same on the second execution, whose processors were kept from the first."""
    silo, _ = silos.register(db, name="read", epsilon=5.0, delta=1e-5, dataset_size=1000)
    with db.write() as session:
        dialect = session.connection().dialect.name
        compiled.run(session, curves.INSERT[dialect], {"curve_hash": "c" * 64, "curve_rdp": "[1.0]"})
        charge_id = compiled.run(session, reserving.INSERT_CHARGE, _values(silo.id, "k1"))
        compiled.run(session, reserving._ENTRIES.insert(), {
            "silo_id": silo.id, "seq": 2, "event": "reserve", "charge_id": charge_id, "epsilon_spent": 0.5,
            "created_at": datetime(2026, 11, 30, 8, 0, 2, tzinfo=UTC), "prev_hash": "p" * 64, "hash": "h" * 64})
    statement = reserving._covering_statement(True)
    values = {"silo_id": silo.id, "since": 1, "idempotency_key": "k1", **{f"seq{i}": 1 for i in range(4)}}
    with db.read() as session:
        expected = session.connection().execute(statement, values).all()
        for _ in range(2):
            read = compiled.rows(session, statement, values)
            assert [tuple(row) for row in read] == [tuple(row) for row in expected] and len(read) == 2
            for ours, theirs in zip(read, expected, strict=True):
                assert ours._asdict() == dict(theirs._mapping)
                assert [type(value) for value in ours] == [type(value) for value in theirs]
    create, reserve = read
    assert create.c_id is None and reserve.c_id == charge_id == reserve.earlier
    assert reserve.event.value == "reserve" and reserve.c_status is ChargeStatus.reserved and reserve.c_rdp == "[1.0]"
    assert reserve.c_created_at.replace(tzinfo=UTC) == datetime(2026, 11, 30, 8, 0, 1, 123456, tzinfo=UTC)  # naive on SQLite
