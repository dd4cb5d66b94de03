"""A retry that waits for its silo's lock while the first attempt commits is answered as a replay of
that attempt: never a second charge, never a 500 from the idempotency key's unique index.

On PostgreSQL a statement that waited for the lock reads everything but the locked row as it was
when it started, before the first attempt committed: so `charges._lock` reads the key's charge in
the next statement (with the entries that cover the silo's record), never in the lock's own. Reading
it in the lock's statement fails this test."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text

from dpledger.service.ledger import charges, silos
from dpledger.service.store.db import Database
from dpledger.service.store.models import Charge
from dpledger.wire.mechanisms import DpSgd

STEP = DpSgd(type="dpsgd", batch_size=10, noise_multiplier=1.1, steps=1)


def wait_until_blocked_on_a_lock(db: Database, timeout: float = 10.0) -> None:
    """PostgreSQL: until a backend waits on a row lock (the retry's locking statement has started and
    taken its snapshot). SQLite: the retry queues for the write lock before any statement; a pause."""
    if db.engine.dialect.name != "postgresql":
        time.sleep(0.3)
        return
    observer = create_engine(db.engine.url)
    deadline = time.monotonic() + timeout
    try:
        with observer.connect() as connection:
            while time.monotonic() < deadline:
                waiting = connection.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )).scalar_one()
                connection.rollback()
                if waiting:
                    return
                time.sleep(0.01)
    finally:
        observer.dispose()
    raise AssertionError("the retry never waited for the silo's lock")


@pytest.mark.parametrize("database_url", ["sqlite", pytest.param("postgres")], indirect=True)
def test_a_retry_that_waited_for_the_lock_replays_the_attempt_that_held_it(database_url: str) -> None:
    db = Database.connect(database_url)
    try:
        silo, _ = silos.register(db, name="waits", epsilon=20.0, delta=1e-5, dataset_size=1000)
        terms = charges.SiloTerms.of(silo)
        charges.reserve(db, silo_id=silo.id, mechanism=STEP, idempotency_key="warm")  # fixes the filter

        holding, release = threading.Event(), threading.Event()
        answers: dict[str, Any] = {}

        def first_attempt() -> None:
            started = charges.start_known(terms, mechanism=STEP, job_id=None, round=None)
            try:
                with db.write() as session:
                    answers["first"] = charges.reserve_locked(
                        session, silo_id=silo.id, priced=started.priced, digest=started.digest,
                        idempotency_key="k", job_id=None, round=None,
                    )
                    holding.set()
                    assert release.wait(30)
            except BaseException as error:  # reported below, not lost in the thread
                answers["first"] = error
                holding.set()

        def retry() -> None:
            started = charges.start_known(terms, mechanism=STEP, job_id=None, round=None)
            try:
                answers["retry"] = charges.finish_reserve(
                    db, started, silo_id=silo.id, idempotency_key="k", job_id=None, round=None, key_id=None,
                    attempt_id=None,
                )
            except BaseException as error:
                answers["retry"] = error

        threads = [threading.Thread(target=first_attempt)]
        threads[0].start()
        assert holding.wait(30)
        threads.append(threading.Thread(target=retry))
        threads[1].start()
        wait_until_blocked_on_a_lock(db)
        release.set()
        for thread in threads:
            thread.join(30)

        first, again = answers["first"], answers["retry"]
        assert isinstance(first, charges.ChargeView), repr(first)
        assert isinstance(again, charges.ChargeView), repr(again)
        assert (first.replayed, again.replayed) == (False, True)
        assert again.charge_id == first.charge_id
        assert again.position.leaf_hash == first.position.leaf_hash  # the receipt of the one reserve entry
        with db.read() as session:
            assert session.scalar(select(func.count()).select_from(Charge).where(Charge.silo_id == silo.id)) == 2
            assert silos.get(session, silo.id).chain_seq == 4  # create, filter, warm's reserve, k's reserve
    finally:
        db.dispose()
