"""The log's sequencer at rest: its leader runs nothing until a commit rings it (store/wakeup.py),
a ring from another process wakes it too (a FIFO on SQLite, NOTIFY on PostgreSQL), a lost ring is
made up by the fallback look, and a PostgreSQL standby waits for the lock on one connection and
takes over the moment the leader's session ends.

Every wait below is far shorter than the fallback (sequencer.FALLBACK_S, 10 s): a leaf sequenced
within it was sequenced because of the ring."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import create_engine, event, text

from dpledger.service.ledger import sequencer, silos
from dpledger.service.ledger.sequencer import Sequencer
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.store import wakeup
from dpledger.service.store.db import Database

WOKEN_WITHIN_S = 3.0  # a ring's batch comes after `interval`; the rest is room for a loaded machine


def pending(db: Database) -> int:
    with db.engine.connect() as connection:
        return int(connection.execute(text("SELECT count(*) FROM log_pending")).scalar_one())


def wait_for(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - t0


def register(db: Database, name: str) -> None:
    silos.register(db, name=name, epsilon=10.0, delta=1e-5, dataset_size=1000)  # its create entry is a leaf


@pytest.fixture
def leader(database_url: str) -> Iterator[tuple[Database, Sequencer]]:
    db = Database.connect(database_url)
    running = Sequencer(db, TreeHeadSigner(Ed25519PrivateKey.generate()), interval=0.02)
    running.start()
    wait_for(lambda: running.leading, 10)
    yield db, running
    running.stop()
    db.dispose()


@pytest.mark.parametrize("database_url", ["sqlite", pytest.param("postgres")], indirect=True)
def test_a_leader_at_rest_runs_nothing_and_a_commit_wakes_it(leader: tuple[Database, Sequencer]) -> None:
    db, running = leader
    register(db, "first")
    wait_for(lambda: pending(db) == 0, WOKEN_WITHIN_S)

    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if threading.current_thread().name == "dpledger-sequencer":
            seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", note)
    try:
        time.sleep(1.0)  # the old leader looked every 100 ms: ten reads here
        assert seen == []
        register(db, "second")  # rings the leader in this process
        wait_for(lambda: pending(db) == 0, WOKEN_WITHIN_S)
    finally:
        event.remove(db.engine, "before_cursor_execute", note)
    assert any("log_pending" in s for s in seen)
    assert running.leading


@pytest.mark.parametrize("database_url", ["sqlite", pytest.param("postgres")], indirect=True)
def test_a_commit_in_another_process_wakes_the_leader(leader: tuple[Database, Sequencer], database_url: str) -> None:
    db, _ = leader
    wait_for(lambda: pending(db) == 0, WOKEN_WITHIN_S)
    time.sleep(wakeup.LINGER_S)  # at rest: nothing but a ring wakes it now
    elsewhere = Database.connect(database_url)  # no sequencer of its own: it rings the leader's FIFO or NOTIFY
    try:
        assert elsewhere.doorbell.local is None
        register(elsewhere, "elsewhere")
        wait_for(lambda: pending(db) == 0, WOKEN_WITHIN_S)
    finally:
        elsewhere.dispose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_lost_ring_is_made_up_by_the_fallback(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    db = Database.connect(database_url)
    monkeypatch.setattr(wakeup.Doorbell, "ring", lambda self: None)
    running = Sequencer(db, TreeHeadSigner(Ed25519PrivateKey.generate()), interval=0.02, fallback=0.5)
    running.start()
    try:
        wait_for(lambda: running.leading, 10)
        register(db, "unrung")  # no ring: the leader finds it at its next fallback look
        took = wait_for(lambda: pending(db) == 0, 10)  # raises if the leaf is never sequenced
        assert pending(db) == 0 and took < 10
    finally:
        running.stop()
        db.dispose()


def waiting_for_the_lock(url: str) -> list[tuple[int, str]]:
    """(pid, backend start) of the sessions waiting for an advisory lock."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return [(int(pid), str(start)) for pid, start in connection.execute(text(
                "SELECT a.pid, a.backend_start FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
                "WHERE a.datname = current_database() AND l.locktype = 'advisory' AND NOT l.granted"))]
    finally:
        engine.dispose()


@pytest.mark.parametrize("database_url", [pytest.param("postgres")], indirect=True)
def test_a_postgres_standby_waits_on_one_connection_and_takes_over_when_the_leader_ends(
    leader: tuple[Database, Sequencer], database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, running = leader
    other = Database.connect(database_url)
    standby = Sequencer(other, TreeHeadSigner(Ed25519PrivateKey.generate()), interval=0.02)
    standby.start()
    try:
        wait_for(lambda: len(waiting_for_the_lock(database_url)) == 1, 10)
        first = waiting_for_the_lock(database_url)
        time.sleep(1.5)  # the old standby opened a new connection every second to try again
        assert waiting_for_the_lock(database_url) == first
        assert not standby.leading

        t0 = time.monotonic()
        standby.stop()  # a stop ends the wait at once (cancelled), not after the lock's timeout
        assert time.monotonic() - t0 < 2.0
        assert waiting_for_the_lock(database_url) == []
        standby.start()
        wait_for(lambda: len(waiting_for_the_lock(database_url)) == 1, 10)

        register(db, "before")
        running.stop()  # the leader's session ends: the standby holds the lock next
        assert wait_for(lambda: standby.leading, 5) < 2.0
        register(other, "after")  # and is rung by its own process's commits
        wait_for(lambda: pending(db) == 0, WOKEN_WITHIN_S)
    finally:
        standby.stop()
        other.dispose()


def test_the_fallback_is_far_inside_the_promise() -> None:
    from dpledger.service.ledger import transparency

    assert sequencer.FALLBACK_S * 3 < transparency.MERGE_DELAY_MS / 1000
    assert wakeup.LINGER_S > wakeup.RING_EVERY_S


def test_a_gather_waits_for_enough_rings_and_no_longer() -> None:
    """After a ring the leader gathers leaves up to a time: it ends as the count of rings since its
    batch began reaches the mark, or at a stop, never later than its time."""
    rings = wakeup.Wakeups()
    try:
        t0 = time.monotonic()
        rings.gather(0.3, 4)  # nothing rings: the whole time
        assert 0.25 <= time.monotonic() - t0 < 2.0

        def ring_later(times: int) -> threading.Thread:
            def run() -> None:
                for _ in range(times):
                    time.sleep(0.02)
                    rings.ring()
            thread = threading.Thread(target=run)
            thread.start()
            return thread

        rings.batch_begins()
        ringer = ring_later(4)
        t0 = time.monotonic()
        rings.gather(30.0, 4)  # four rings end it long before its time
        assert time.monotonic() - t0 < 5.0
        ringer.join()
        assert rings.rings == 4

        t0 = time.monotonic()
        rings.gather(0.2, 4)  # rings before it, since the batch began, count: it does not wait
        assert time.monotonic() - t0 < 0.15

        rings.batch_begins()
        threading.Timer(0.05, rings.interrupt).start()
        t0 = time.monotonic()
        rings.gather(30.0, 4)  # a stop ends it
        assert time.monotonic() - t0 < 5.0
    finally:
        rings.close()


def test_the_gathering_stays_far_inside_the_promise() -> None:
    from dpledger.service.ledger import transparency

    assert sequencer.GATHER_MAX_S * 30 < transparency.MERGE_DELAY_MS / 1000
    assert sequencer.GATHER_LEAVES <= transparency.BATCH
    db = Database.connect("sqlite://")
    try:
        for interval, gathering in [(0.01, 0.09), (0.1, 0.9), (0.5, 0.5), (1.0, 0.0), (60.0, 0.0)]:
            # the ring's interval and the gathering after it: never more than GATHER_MAX_S in all
            built = Sequencer(db, TreeHeadSigner(Ed25519PrivateKey.generate()), interval=interval)
            assert built._gathering_s == pytest.approx(gathering)
    finally:
        db.dispose()
