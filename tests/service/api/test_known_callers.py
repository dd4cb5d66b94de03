"""A repeated approval skips the read of its key and silo (service/api/known.py): what the process
kept must never approve what a fresh read would refuse. A key revoked since writes nothing; a silo
whose record was sealed with other terms since is priced under the sealed terms."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from dpledger.service.accounting import rdp
from dpledger.service.api.deps import Principal
from dpledger.service.api.known import Known
from dpledger.service.ledger.charges import SiloTerms
from dpledger.wire.enums import Relation, Role
from tests.conftest import ADMIN, bearer

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}


def registered(client: TestClient, name: str) -> tuple[int, dict[str, str]]:
    created = client.post("/v1/silos", headers=ADMIN, json={"name": name, "epsilon": 5.0, "delta": 1e-5, "dataset_size": 1000})
    assert created.status_code == 201, created.text
    return created.json()["id"], bearer(created.json()["api_key"])


def charge(client: TestClient, silo_id: int, headers: dict[str, str], key: str) -> Any:
    return client.post(f"/v1/silos/{silo_id}/charges", headers=headers, json={"mechanism": STEP, "idempotency_key": key})


def charge_count(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            return int(connection.execute(text("SELECT count(*) FROM charges")).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite", pytest.param("postgres")], indirect=True)
def test_a_key_revoked_after_it_was_served_writes_nothing(client: TestClient, database_url: str) -> None:
    silo_id, headers = registered(client, "revoked-later")
    assert charge(client, silo_id, headers, "first").status_code == 201  # the key and the silo are known now
    key_id = client.get("/v1/keys/me", headers=headers).json()["key_id"]
    assert client.delete(f"/v1/keys/{key_id}", headers=ADMIN).status_code == 204
    before = charge_count(database_url)

    refused = charge(client, silo_id, headers, "after-revocation")

    assert refused.status_code == 401, refused.text
    assert refused.json()["detail"] == "unknown or revoked API key"
    assert charge_count(database_url) == before
    # Forgotten: the next request is read and refused before it is priced (a new pair is not computed).
    fresh = {**STEP, "noise_multiplier": 1.2345}
    misses = rdp._sampled_gaussian_cached.cache_info().misses
    again = client.post(f"/v1/silos/{silo_id}/charges", headers=headers, json={"mechanism": fresh, "idempotency_key": "x"})
    assert again.status_code == 401 and rdp._sampled_gaussian_cached.cache_info().misses == misses


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_record_sealed_with_another_dataset_size_is_priced_under_it(client: TestClient, database_url: str) -> None:
    silo_id, headers = registered(client, "resized")
    assert charge(client, silo_id, headers, "first").status_code == 201  # terms known: dataset_size 1000
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE silos SET dataset_size = 2000 WHERE id = :id"), {"id": silo_id})
        assert charge(client, silo_id, headers, "edited").status_code == 409  # named, never priced from it
        assert client.post(f"/v1/silos/{silo_id}/seal", headers=ADMIN).status_code == 200

        approved = charge(client, silo_id, headers, "after-seal")

        assert approved.status_code == 201, approved.text
        with engine.begin() as connection:
            stored = connection.execute(text("SELECT mechanism FROM charges WHERE id = :id"),
                                        {"id": approved.json()["charge_id"]}).scalar_one()
    finally:
        engine.dispose()
    assert json.loads(stored)["sampling_rate"] == 10 / 2000  # not 10 / 1000, the terms the process kept


def test_what_a_process_keeps_is_bounded() -> None:
    known = Known(limit=2)
    for index in range(5):
        credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials=f"key-{index}")
        caller = Principal(key_id=index, role=Role.silo, silo_id=index)
        known.remember(credentials, caller, index, SiloTerms(100, Relation.add_remove))
    assert len(known._principals) <= 2 and len(known._terms) <= 2
    last = HTTPAuthorizationCredentials(scheme="Bearer", credentials="key-4")
    assert known.principal(last) == Principal(key_id=4, role=Role.silo, silo_id=4)
    assert known.terms(4) == SiloTerms(100, Relation.add_remove)
