"""The SQL one approval costs: counted with SQLAlchemy's `before_cursor_execute` on the app's engine,
so that a statement added to the hot path (an ORM load, a second session, a check done twice) fails
here instead of showing up only as CPU in bench/approvals.py."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from sqlalchemy import event

from tests.conftest import ADMIN

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}
# Statements of one fresh approval on a silo whose filter is fixed, a (q, σ) pair seen before, a key
# and silo this process has approved for (service/api/known.py) and a fresh idempotency key: one write
# transaction (the silo locked with its caller's key read live and the idempotency key's earlier
# charge, its record checked, the charge, the silo's new state, its entry and the log's pending leaf:
# on PostgreSQL those four in one statement, store/postgres.py `append`). Its
# transaction's control is counted apart: SQLite's BEGIN IMMEDIATE, or a savepoint pair where the
# approval joined a group of writers that another opened (store/db.py GroupCommit: the sequencer's
# batch, say); none on PostgreSQL.
APPROVAL_STATEMENTS = {"sqlite": 6, "postgresql": 3}
CONTROL = {"sqlite": (["BEGIN IMMEDIATE"], ["SAVEPOINT", "RELEASE"]), "postgresql": ([],)}


def statements_of(app: Any, call: Any) -> list[str]:
    """The SQL the app's engine ran during `call()`, leaving out the log's sequencer (its own thread)."""
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if threading.current_thread().name != "dpledger-sequencer":
            seen.append(" ".join(statement.split()))

    engine = app.state.engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", note)
    return seen


@pytest.mark.parametrize("database_url", ["sqlite", pytest.param("postgres")], indirect=True)
def test_one_approval_runs_a_fixed_small_number_of_statements(app, client, make_silo) -> None:
    silo = make_silo(epsilon=50.0)
    path = f"/v1/silos/{silo.id}/charges"
    first = client.post(path, json={"mechanism": STEP, "idempotency_key": "warm"}, headers=silo.headers)
    assert first.status_code == 201, first.text  # the pair's curve is cached now

    answers: list[Any] = []
    seen = statements_of(app, lambda: answers.append(
        client.post(path, json={"mechanism": STEP, "idempotency_key": "counted"}, headers=silo.headers)))

    assert answers[0].status_code == 201, answers[0].text
    dialect = app.state.engine.dialect.name
    control = [s.split()[0] if s.startswith(("SAVEPOINT", "RELEASE")) else s for s in seen
               if s.startswith(("BEGIN", "SAVEPOINT", "RELEASE", "COMMIT", "ROLLBACK"))]
    assert control in CONTROL[dialect], "\n".join(seen)
    assert len(seen) - len(control) == APPROVAL_STATEMENTS[dialect], "\n".join(seen)
    # What was written: one charge, one entry, the silo's state, one pending leaf; nothing else.
    writes = sorted(f"{verb} {table}" for s in seen for verb, table in re.findall(r"(?<!FOR )(INSERT INTO|UPDATE) (\w+)", s))
    assert writes == ["INSERT INTO charges", "INSERT INTO ledger_entries", "INSERT INTO log_pending", "UPDATE silos"], writes
    assert client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()[-1]["event"] == "reserve"
