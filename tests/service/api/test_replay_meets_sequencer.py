"""A replayed request whose receipt the sequencer moves into the log while the replay reads it: the
replay still answers its receipt. The sequencer moves a leaf from `log_pending` to `log_leaves` in
one transaction; a read that looked in one table, then the other, each on its own snapshot
(PostgreSQL's READ COMMITTED), found it in neither and answered 404 (CI met it by chance)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from sqlalchemy import event

from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from tests.conftest import ADMIN_KEY

CHARGE = {"mechanism": {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}}
SEARCH = {"trial": CHARGE["mechanism"], "mean_trials": 10, "distribution": {"kind": "geometric"}}


@pytest.fixture
def app(database_url: str) -> Iterator[Any]:
    # The sequencer runs once at start, then waits a minute: the test moves leaves itself.
    application = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY, log_sequence_interval_ms=60_000))
    yield application
    application.state.engine.dispose()


def sequence_when_a_read_first_looks_for_the_leaf(app: Any, done: Future[int]) -> None:
    """Runs the sequencer once, on a thread of its own, right after the first statement that reads
    the log's tables, and lets the read go on once it has committed (or after 5 s: a SQLite replay
    found inside the write lock holds the sequencer back until it ends)."""
    started = threading.Event()

    @event.listens_for(app.state.engine, "after_cursor_execute")
    def _after(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if started.is_set() or not ("FROM log_leaves" in statement or "FROM log_pending" in statement):
            return
        started.set()  # once: the sequencer's own statements pass through here too
        thread = threading.Thread(target=lambda: done.set_result(app.state.sequencer.run_once()), daemon=True)
        thread.start()
        thread.join(timeout=5)


@pytest.mark.parametrize(("path", "body"), [("charges", CHARGE), ("searches", SEARCH)])
def test_a_replay_answers_its_receipt_though_the_leaf_was_sequenced_mid_read(client, make_silo, app, path, body) -> None:  # type: ignore[no-untyped-def]
    silo = make_silo(epsilon=100.0)
    request = {**body, "idempotency_key": "once"}
    first = client.post(f"/v1/silos/{silo.id}/{path}", json=request, headers=silo.headers)
    assert first.status_code == 201, first.text
    assert first.json()["receipt"]["log_index"] is None  # still pending: nothing sequenced it yet

    moved: Future[int] = Future()
    sequence_when_a_read_first_looks_for_the_leaf(app, moved)
    again = client.post(f"/v1/silos/{silo.id}/{path}", json=request, headers=silo.headers)

    assert moved.result(timeout=30) >= 1  # the replay's leaf (with the silo's create entry) left log_pending
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["receipt"]["leaf_hash"] == first.json()["receipt"]["leaf_hash"]
