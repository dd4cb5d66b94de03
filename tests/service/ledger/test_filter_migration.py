"""Revision 0005 on a ledger written before filters existed (at revision 0004, with its transparency
log): a silo that holds charges moves to the
union bound over every order the old rule gated it on (δ split evenly), one without charges gets the
filter it would get today, each recorded in a new `filter` entry, and the audit still verifies."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from alembic import command
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_to_json
from dpledger.service.api.app import create_app
from dpledger.service.ledger import chain, transparency
from dpledger.service.settings import Settings
from dpledger.service.store.db import alembic_config
from dpledger.wire.mechanisms import DpSgd
from tests.conftest import ADMIN, ADMIN_KEY
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon

STEP = DpSgd(noise_multiplier=1.0, steps=50, sampling_rate=0.02)


def write_old_ledger(url: str) -> dict[str, int]:
    """Two silos as revision 0004's code wrote them: 'old' with one committed charge, 'fresh' with
    none; ids come from the database (so PostgreSQL's sequences stay right), hashes from chain.py,
    every entry appended to the transparency log by transparency.append."""
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    curve = rdp.rdp_curve(STEP)  # what the old ledger stored: dp-accounting's curve
    spent = RunningSum.empty(len(rdp.ORDERS)).add(curve).to_json()
    empty = RunningSum.empty(len(rdp.ORDERS)).to_json()
    ids: dict[str, int] = {}
    engine = create_engine(url)
    with engine.begin() as connection:
        log = Session(bind=connection)
        for name, running, with_charge in (("old", spent, True), ("fresh", empty, False)):
            silo_id = connection.execute(text(
                "INSERT INTO silos (name, epsilon, delta, dataset_size, rdp_spent, rdp_committed, chain_seq, chain_head, "
                "created_at) VALUES (:name, 10.0, 1e-5, 1000, :s, :s, 0, :h, :t) RETURNING id"),
                {"name": name, "s": running, "h": chain.GENESIS, "t": now}).scalar_one()
            ids[name] = silo_id
            silo = SimpleNamespace(id=silo_id, name=name, epsilon=10.0, delta=1e-5, dataset_size=1000, created_at=now,
                                   relation="add_remove")
            entries = [SimpleNamespace(silo_id=silo_id, seq=1, event="create", charge_id=None, epsilon_spent=0.0,
                                       created_at=now, prev_hash=chain.GENESIS)]
            entries[0].hash = chain.entry_hash(entries[0], subject=chain.silo_fields(silo))  # type: ignore[arg-type]
            if with_charge:
                charge = SimpleNamespace(
                    silo_id=silo_id, idempotency_key="k", request_hash="0" * 64, mechanism=STEP.model_dump_json(),
                    rdp=curve_to_json(curve), order_grid=rdp.ORDER_GRID_ID, conversion=rdp.CONVERSION_ID,
                    epsilon_spent_after=rdp.epsilon(curve, delta=1e-5)[0], created_at=now,
                )
                charge.id = connection.execute(text(
                    "INSERT INTO charges (silo_id, idempotency_key, request_hash, mechanism, rdp, order_grid, conversion, "
                    "status, job_id, round, epsilon_spent_after, created_at) VALUES (:silo_id, :idempotency_key, "
                    ":request_hash, :mechanism, :rdp, :order_grid, :conversion, 'committed', NULL, NULL, "
                    ":epsilon_spent_after, :created_at) RETURNING id"), vars(charge)).scalar_one()
                charge.job_id, charge.round = None, None
                for seq, event in ((2, "reserve"), (3, "commit")):
                    entry = SimpleNamespace(silo_id=silo_id, seq=seq, event=event, charge_id=charge.id,
                                            epsilon_spent=charge.epsilon_spent_after, created_at=now, prev_hash=entries[-1].hash)
                    entry.hash = chain.entry_hash(entry, subject=chain.charge_fields(charge))  # type: ignore[arg-type]
                    entries.append(entry)
            for e in entries:
                e.id = connection.execute(text(
                    "INSERT INTO ledger_entries (silo_id, seq, event, charge_id, epsilon_spent, created_at, prev_hash, hash) "
                    "VALUES (:silo_id, :seq, :event, :charge_id, :epsilon_spent, :created_at, :prev_hash, :hash) RETURNING id"),
                    vars(e)).scalar_one()
                subject = chain.silo_fields(silo) if e.charge_id is None else chain.charge_fields(charge)  # type: ignore[arg-type]
                transparency.append(log, e, subject=subject)  # type: ignore[arg-type]
            connection.execute(text("UPDATE silos SET chain_seq = :n, chain_head = :h WHERE id = :i"),
                               {"n": len(entries), "h": entries[-1].hash, "i": silo_id})
    engine.dispose()
    return ids


@pytest.fixture
def migrated(database_url: str):  # type: ignore[no-untyped-def]
    config = alembic_config(database_url)
    command.downgrade(config, "0004")
    ids = write_old_ledger(database_url)
    command.upgrade(config, "head")
    application = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
    with TestClient(application) as client:
        yield client, ids
    application.state.engine.dispose()


def test_old_silos_get_a_proven_filter_in_a_new_entry_and_the_ledger_still_verifies(migrated) -> None:  # type: ignore[no-untyped-def]
    client, ids = migrated
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True

    old = client.get(f"/v1/silos/{ids['old']}", headers=ADMIN).json()
    assert old["filter"]["source"] == "legacy" and len(old["filter"]["orders"]) == len(rdp_lib.DEFAULT_RDP_ORDERS)
    history = client.get(f"/v1/silos/{ids['old']}/history", headers=ADMIN).json()
    assert [e["event"] for e in history] == ["create", "reserve", "commit", "filter"]
    # Its spend is now the union bound over all 156 orders with δ/156 each, on the curve it stored.
    legacy = proven_epsilon(filter_of(old), rdp.rdp_curve(STEP), delta=1e-5)
    assert old["epsilon_spent"] == pytest.approx(legacy, rel=1e-12) and history[-1]["epsilon_spent"] == old["epsilon_spent"]
    assert old["epsilon_spent"] > rdp.epsilon(rdp.rdp_curve(STEP), delta=1e-5)[0]

    fresh = client.get(f"/v1/silos/{ids['fresh']}", headers=ADMIN).json()
    assert fresh["filter"]["source"] == "horizon" and fresh["filter"]["weights"][0] > 0.5
    assert [e["event"] for e in client.get(f"/v1/silos/{ids['fresh']}/history", headers=ADMIN).json()] == ["create", "filter"]


def test_a_migrated_silo_is_gated_by_its_filter_and_an_edited_filter_is_caught(migrated, database_url: str) -> None:  # type: ignore[no-untyped-def]
    client, ids = migrated
    key = client.post("/v1/keys", json={"role": "silo", "silo_id": ids["old"]}, headers=ADMIN).json()["api_key"]
    response = client.post(f"/v1/silos/{ids['old']}/charges", headers={"Authorization": f"Bearer {key}"},
                           json={"mechanism": {"type": "dpsgd", "batch_size": 20, "noise_multiplier": 1.0, "steps": 50},
                                 "idempotency_key": "after"})
    assert response.status_code == 201, response.text
    detail = client.get(f"/v1/silos/{ids['old']}", headers=ADMIN).json()
    # The stored charge keeps dp-accounting's curve; the new one is charged with certified fractional orders.
    expected = rdp.rdp_curve(STEP) + dpsgd_curve([(0.02, 1.0, 50)])
    assert detail["epsilon_spent"] == pytest.approx(proven_epsilon(filter_of(detail), expected, delta=1e-5), rel=1e-9)
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True

    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE silos SET filter_seq = 1 WHERE id = :i"), {"i": ids["old"]})
    report = client.get("/v1/audit/verify", headers=ADMIN).json()
    assert report["ok"] is False and report["first_bad_silo_id"] == ids["old"]
    engine.dispose()
