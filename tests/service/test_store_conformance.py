"""One contract, two databases: the approval's store (service/store/reserving.py) held to the same rules on
SQLite and on PostgreSQL, as tests/trainer/test_round_protocol.py holds the three round runners.

- the lock reads the silo and the caller's key live, and nothing else decides;
- the charge an idempotency key names is seen by the read after the lock, even when a retry under that
  key committed while this transaction waited for the lock (exactly once under READ COMMITTED);
- an approval costs a fixed number of statements;
- a crash between any two of its statements leaves the ledger as it was (nothing half written);
- what `append` writes is what the domain then reads (the silo's columns, the entry, its pending leaf,
  the charge and its curve, written once).
The API-level suites (test_exactly_once, the crash and fault suites, test_tampered_silo) run the same
paths through the service; these hold the store itself to its contract.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from sqlalchemy import event, func, select

from dpledger.service.accounting.running_sum import curve_to_json
from dpledger.service.ledger import chain, keys, silos, transparency
from dpledger.service.store import curves, reserving
from dpledger.service.store.db import Database
from dpledger.service.store.models import (
    SILO_COLUMNS,
    ApiKey,
    Charge,
    ChargeRecord,
    ChargeStatus,
    Curve,
    EntryEvent,
    EntryRecord,
    LedgerEntry,
    LogPending,
    Silo,
    SiloRecord,
)
from dpledger.wire.mechanisms import DpSgd

pytestmark = pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
STEP = DpSgd(batch_size=10, noise_multiplier=1.1, steps=1)
# lock, record check (with the key's charge), then SQLite: charge, silo, entry, leaf; PostgreSQL: one
# statement for all four (the charge's id came with the lock).
STATEMENTS = {"sqlite": 6, "postgresql": 3}


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database.connect(database_url)
    yield database
    database.dispose()


@pytest.fixture
def silo_and_key(db: Database) -> tuple[int, int]:
    silo, _ = silos.register(db, name="conformance", epsilon=10.0, delta=1e-5, dataset_size=1000, horizon=STEP)
    with db.read() as session:
        key = session.scalars(select(ApiKey).where(ApiKey.silo_id == silo.id)).one()
    return silo.id, key.id


def _values(silo_id: int, key: str, curve_hash: str) -> dict[str, Any]:
    return {
        "silo_id": silo_id, "idempotency_key": key, "request_hash": f"request-{key}", "mechanism": STEP.model_dump_json(),
        "curve_hash": curve_hash, "order_grid": "grid", "conversion": "conversion", "status": ChargeStatus.reserved,
        "job_id": None, "round": None, "epsilon_spent_after": 0.5, "created_at": datetime.now(UTC), "touched_at": None,
        "attempt_id": None,
    }


def _approve(session: Any, silo_id: int, key_id: int | None, idempotency_key: str,
             after: Any = lambda step: None) -> int | None:
    """The approval's store calls in the domain's order (ledger/charges.py), `after(step)` between them;
    the charge's id, or the earlier charge's where the key names one (nothing written then)."""
    store = reserving.of(session)
    locked = store.lock(session, silo_id=silo_id, key_id=key_id)
    assert locked is not None and locked.key_live
    after("lock")
    silo = locked.silo
    _, earlier = reserving.covering_entries(
        session, silo_id=silo_id, seqs=[1], since=silo.chain_seq, key=reserving.AfterLock(locked, idempotency_key))
    after("covering")
    if earlier is not None:
        return earlier
    text = curve_to_json(np.linspace(0.0, 1.0, 8))
    curve_hash, new_curve = curves.reference(session, text)
    values = _values(silo_id, idempotency_key, curve_hash)
    new = store.insert_charge(session, values, locked=locked, curve=(curve_hash, text) if new_curve else None)
    after("charge")
    entry = EntryRecord(silo_id=silo_id, seq=silo.chain_seq + 1, event=EntryEvent.reserve, charge_id=new.id,
                        epsilon_spent=0.5, created_at=values["created_at"], prev_hash=silo.chain_head, hash="")
    subject = chain.canonical(chain.subject(EntryEvent.reserve, silo, ChargeRecord(id=new.id, rdp=text, **values)))
    entry.hash = chain.entry_hash(entry, subject_text=subject)
    leaf, _ = transparency.pending_leaf(entry, subject_text=subject)
    store.append(session, reserving.Appended(
        silo_id, {"chain_seq": entry.seq, "chain_head": entry.hash},
        {column: getattr(entry, column) for column in reserving.ENTRY_COLUMNS}, leaf, new))
    after("append")
    return new.id


def _counts(db: Database) -> tuple[int, ...]:
    with db.read() as session:
        counts = [int(session.scalar(select(func.count()).select_from(table)) or 0)
                  for table in (Charge, LedgerEntry, LogPending, Curve)]
        return (*counts, int(session.scalar(select(Silo.chain_seq)) or 0))


def test_the_lock_reads_the_silo_and_the_key_live(db: Database, silo_and_key: tuple[int, int]) -> None:
    silo_id, key_id = silo_and_key
    with db.write() as session:
        store = reserving.of(session)
        assert store.lock(session, silo_id=silo_id + 1, key_id=key_id) is None
        locked = store.lock(session, silo_id=silo_id, key_id=key_id)
        assert locked is not None and locked.silo.id == silo_id and locked.key_live
        anonymous = store.lock(session, silo_id=silo_id, key_id=None)
        assert anonymous is not None and anonymous.key_live
        unknown = store.lock(session, silo_id=silo_id, key_id=key_id + 100)
        assert unknown is not None and not unknown.key_live
        # PostgreSQL hands out the charge's id with the lock (each lock its own); SQLite's insert returns it.
        ids = [x.next_id for x in (locked, anonymous, unknown)]
        assert ids == [None] * 3 if db.engine.dialect.name == "sqlite" else len(set(ids)) == 3
    keys.revoke(db, key_id)
    with db.write() as session:
        revoked = reserving.of(session).lock(session, silo_id=silo_id, key_id=key_id)
        assert revoked is not None and not revoked.key_live


def test_the_locked_record_is_the_silo_row_and_what_an_approval_changes_on_it_is_written(
    db: Database, silo_and_key: tuple[int, int],
) -> None:
    silo_id, key_id = silo_and_key
    assert SILO_COLUMNS == tuple(column.key for column in Silo.__table__.columns)
    with db.write() as session:
        locked = reserving.of(session).lock(session, silo_id=silo_id, key_id=key_id)
        assert locked is not None and isinstance(locked.silo, SiloRecord)
        record = locked.silo
        orm = session.get(Silo, silo_id)
        assert orm is not None
        for name in SILO_COLUMNS:  # each value as the ORM reads it, type included
            assert (getattr(record, name), type(getattr(record, name))) == (getattr(orm, name), type(getattr(orm, name)))
        assert record.changed() == {}
        record.plan_used += 3
        record.filter_spec = record.filter_spec + " "
        changed = record.changed()
        assert changed == {"plan_used": orm.plan_used + 3, "filter_spec": orm.filter_spec + " "}
        reserving.store_columns(session, silo_id, changed)
        record.stored(changed)
        assert record.changed() == {}
    with db.read() as session:
        stored = session.get(Silo, silo_id)
        assert stored is not None and (stored.plan_used, stored.filter_spec) == (changed["plan_used"], changed["filter_spec"])


def test_an_approval_writes_each_row_once_in_a_fixed_number_of_statements(
        db: Database, silo_and_key: tuple[int, int]) -> None:
    silo_id, key_id = silo_and_key
    before = _counts(db)
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if not statement.lstrip().upper().startswith(("BEGIN", "SAVEPOINT", "RELEASE", "COMMIT", "ROLLBACK")):
            seen.append(statement)

    with db.write() as session:
        _approve(session, silo_id, key_id, "first")  # writes its curve
    event.listen(db.engine, "before_cursor_execute", note)
    try:
        with db.write() as session:
            charge_id = _approve(session, silo_id, key_id, "second")  # a curve this process knows it stored
    finally:
        event.remove(db.engine, "before_cursor_execute", note)
    assert len(seen) == STATEMENTS[db.engine.dialect.name], seen
    assert _counts(db) == (before[0] + 2, before[1] + 2, before[2] + 2, before[3] + 1, before[4] + 2)
    with db.read() as session:
        charge = session.get(Charge, charge_id)
        assert charge is not None and charge.idempotency_key == "second" and charge.rdp.startswith("[")
        entry = session.scalars(select(LedgerEntry).where(LedgerEntry.charge_id == charge_id)).one()
        silo = session.get(Silo, silo_id)
        assert silo is not None and (silo.chain_seq, silo.chain_head) == (entry.seq, entry.hash)
        assert session.scalars(select(LogPending).where(LogPending.entry_id == entry.id)).one().leaf_hash


@pytest.mark.parametrize("step", ["lock", "covering", "charge", "append"])
def test_a_crash_after_any_statement_leaves_the_ledger_as_it_was(
        db: Database, silo_and_key: tuple[int, int], step: str) -> None:
    silo_id, key_id = silo_and_key
    before = _counts(db)

    class Crash(Exception):
        pass

    def crash(at: str) -> None:
        if at == step:
            raise Crash

    with pytest.raises(Crash), db.write() as session:
        _approve(session, silo_id, key_id, "crashed", crash)
    assert _counts(db) == before
    with db.write() as session:  # and the same key approves once, afterwards
        assert _approve(session, silo_id, key_id, "crashed") is not None
    assert _counts(db)[0] == before[0] + 1


def test_a_retry_that_committed_while_the_lock_was_awaited_is_seen(
        db: Database, silo_and_key: tuple[int, int]) -> None:
    """The first transaction holds the silo's lock and commits a charge under key K; the second asked
    for the lock meanwhile. Its read after the lock must name that charge, not approve K again."""
    silo_id, key_id = silo_and_key
    holding, waiting = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def first() -> None:
        with db.write() as session:
            def hold(at: str) -> None:
                if at == "append":
                    holding.set()
                    waiting.wait(5)
                    time.sleep(0.3)  # the second transaction is waiting for the lock now
            outcome["first"] = _approve(session, silo_id, key_id, "K", hold)

    def second() -> None:
        holding.wait(10)
        waiting.set()
        with db.write() as session:
            outcome["second"] = _approve(session, silo_id, key_id, "K")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert outcome["first"] is not None and outcome["second"] == outcome["first"]
    with db.read() as session:
        assert session.scalar(select(func.count()).select_from(Charge).where(Charge.idempotency_key == "K")) == 1
