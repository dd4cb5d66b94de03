from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect, text

from dpledger.cli import openapi_document
from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from dpledger.service.store.db import alembic_config
from dpledger.service.store.models import Base
from tests.conftest import ADMIN, ADMIN_KEY

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_openapi_document_is_the_one_the_app_generates() -> None:
    committed = (ROOT / "openapi" / "openapi.json").read_text()
    assert committed == openapi_document(), "openapi/ drifted from the app: run `dpledger openapi`"


def test_operation_ids_are_the_stable_route_names() -> None:
    document = json.loads(openapi_document())
    ids = {op["operationId"] for path in document["paths"].values() for op in path.values()}
    assert {"reserve_charge", "commit_charge", "release_charge", "get_silo", "silo_history", "verify_ledger"} <= ids


def test_migrations_build_exactly_the_models_and_downgrade_cleanly(database_url: str) -> None:
    engine = create_engine(database_url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == []
    command.downgrade(alembic_config(database_url), "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    command.upgrade(alembic_config(database_url), "head")
    assert {"silos", "charges", "ledger_entries", "api_keys"} <= set(inspect(create_engine(database_url)).get_table_names())
    engine.dispose()


def test_revision_0012_keeps_silos_across_a_round_trip_and_refuses_to_downgrade_a_retired_one(database_url: str) -> None:
    """The retirement's columns come and go with revision 0012; a ledger holding a retired silo is not
    downgraded below it, since the code there would approve on that silo again."""
    def serve() -> TestClient:
        app = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
        served.append(app)
        return TestClient(app)

    served: list[Any] = []
    config, engine = alembic_config(database_url), create_engine(database_url)

    def columns() -> set[str]:
        return {c["name"] for c in inspect(engine).get_columns("silos")}

    def version() -> str:
        with engine.connect() as connection:
            return str(connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one())

    body = {"name": "ward", "epsilon": 3.0, "delta": 1e-5, "dataset_size": 1000}
    with serve() as client:
        silo_id = client.post("/v1/silos", json=body, headers=ADMIN).json()["id"]
    served[-1].state.engine.dispose()
    command.downgrade(config, "0011")
    assert {"retired_seq", "retired_reason"}.isdisjoint(columns()) and version() == "0011"
    command.upgrade(config, "head")
    assert {"retired_seq", "retired_reason"} <= columns()
    with serve() as client:
        assert client.get(f"/v1/silos/{silo_id}", headers=ADMIN).json()["retired_seq"] is None  # in service, as it was
        retired = client.post(f"/v1/silos/{silo_id}/retire", json={"reason": "wrong size"}, headers=ADMIN)
        assert retired.status_code == 200 and retired.json()["retired_seq"] == 2
    served[-1].state.engine.dispose()
    with pytest.raises(RuntimeError, match=rf"silos {silo_id} are retired: code below revision 0012 would approve"):
        command.downgrade(config, "0011")
    # Refused at 0012: SQLite has stepped down from the head to it, PostgreSQL's transactional DDL undid that step.
    assert {"retired_seq", "retired_reason"} <= columns() and version() in ("0012", "0013", "0014", "0015")
    engine.dispose()


def test_revision_0013_refuses_to_downgrade_a_silo_whose_registered_filter_was_refit(database_url: str) -> None:
    """Below 0013 a refit silo's create entry would recompute without the filter it covered."""
    config, engine = alembic_config(database_url), create_engine(database_url)
    app = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
    declared = {"type": "dpsgd", "batch_size": 256, "noise_multiplier": 1.0, "steps": 1}
    step = {"type": "dpsgd", "batch_size": 78, "noise_multiplier": 1.174, "steps": 1}
    with TestClient(app) as client:
        made = client.post("/v1/silos", headers=ADMIN, json={"name": "refit", "epsilon": 0.4567, "delta": 1e-5,
                                                             "dataset_size": 60_000, "horizon": declared}).json()
        charged = client.post(f"/v1/silos/{made['id']}/charges", headers={"Authorization": f"Bearer {made['api_key']}"},
                              json={"mechanism": step, "idempotency_key": "u1"})
        assert charged.status_code == 201 and client.get(f"/v1/silos/{made['id']}", headers=ADMIN).json()["filter"][
            "source"] == "refit", charged.text
    app.state.engine.dispose()
    with pytest.raises(RuntimeError, match=rf"silos {made['id']} had their registered filter refit by their first charge"):
        command.downgrade(config, "0012")
    engine.dispose()


def test_revision_0014_moves_each_charge_curve_into_one_row_per_curve_and_back(database_url: str) -> None:
    """0014 keys each distinct curve text by its SHA-256 in `curves` and points the charges at it; its
    downgrade puts each charge's text back. Every entry still recomputes to its hash either way."""
    config, engine = alembic_config(database_url), create_engine(database_url)
    pairs = [{"type": "dpsgd", "batch_size": 10, "noise_multiplier": sigma, "steps": 1} for sigma in (1.0, 1.0, 1.3, 1.0)]

    def serve_and_verify(charge: bool) -> None:
        app = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
        with TestClient(app) as client:
            if charge:
                made = client.post("/v1/silos", headers=ADMIN, json={"name": "curves", "epsilon": 50.0, "delta": 1e-5,
                                                                     "dataset_size": 1000}).json()
                for i, step in enumerate(pairs):
                    answer = client.post(f"/v1/silos/{made['id']}/charges", json={"mechanism": step, "idempotency_key": f"k{i}"},
                                         headers={"Authorization": f"Bearer {made['api_key']}"})
                    assert answer.status_code == 201, answer.text
            assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
        app.state.engine.dispose()

    serve_and_verify(charge=True)
    with engine.connect() as connection:
        stored = dict(connection.execute(text("SELECT charges.id, curves.rdp FROM charges JOIN curves "
                                              "ON curves.hash = charges.curve_hash")).tuples().all())
        assert connection.execute(text("SELECT count(*) FROM curves")).scalar_one() == 2  # two pairs, two rows
    command.downgrade(config, "0013")
    assert "curves" not in inspect(engine).get_table_names()
    with engine.connect() as connection:
        assert dict(connection.execute(text("SELECT id, rdp FROM charges")).tuples().all()) == stored
    command.upgrade(config, "head")
    with engine.connect() as connection:
        assert dict(connection.execute(text("SELECT charges.id, curves.rdp FROM charges JOIN curves "
                                            "ON curves.hash = charges.curve_hash")).tuples().all()) == stored
        assert connection.execute(text("SELECT count(*) FROM curves")).scalar_one() == 2
    engine.dispose()
    serve_and_verify(charge=False)


def test_revision_0015_stores_the_running_sums_in_base64_value_for_value_and_back(database_url: str) -> None:
    """0015 rewrites each silo's two running sums from JSON into the base64 of their float64 bytes
    (exact), keeps them in the row on PostgreSQL (STORAGE MAIN, fillfactor 50); its downgrade writes
    JSON back. The audit reads the ledger clean at every step."""
    config, engine = alembic_config(database_url), create_engine(database_url)
    app = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
    step = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 3}
    with TestClient(app) as client:
        made = client.post("/v1/silos", headers=ADMIN, json={"name": "sums", "epsilon": 50.0, "delta": 1e-5,
                                                             "dataset_size": 1000}).json()
        for i in range(3):
            answer = client.post(f"/v1/silos/{made['id']}/charges", json={"mechanism": step, "idempotency_key": f"k{i}"},
                                 headers={"Authorization": f"Bearer {made['api_key']}"})
            assert answer.status_code == 201, answer.text
    app.state.engine.dispose()

    def sums() -> tuple[str, str]:
        with engine.connect() as connection:
            row = connection.execute(text("SELECT rdp_spent, rdp_committed FROM silos WHERE id = :id"),
                                     {"id": made["id"]}).one()
        return row.rdp_spent, row.rdp_committed

    def audited_clean() -> None:
        served = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
        with TestClient(served) as client:
            assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
        served.state.engine.dispose()

    new = sums()
    assert all(s.startswith("b64:") for s in new)
    audited_clean()
    command.downgrade(config, "0014")
    old = sums()
    for stored, written in zip(new, old, strict=True):
        data = json.loads(written)
        assert np.array(data["finite"], dtype="<f8").tobytes() == base64.b64decode(stored[4:])
        assert data["infinite"] == [0] * len(data["finite"])
    audited_clean()
    command.upgrade(config, "head")
    assert sums() == new  # value for value: the very text the service writes
    if engine.dialect.name == "postgresql":
        with engine.connect() as connection:
            storage = dict(connection.execute(text(
                "SELECT attname, attstorage FROM pg_attribute WHERE attrelid = 'silos'::regclass "
                "AND attname IN ('rdp_spent', 'rdp_committed')")).tuples().all())
            options = connection.execute(text("SELECT reloptions FROM pg_class WHERE oid = 'silos'::regclass")).scalar_one()
        assert storage == {"rdp_spent": "m", "rdp_committed": "m"} and options == ["fillfactor=50"]
    audited_clean()
    engine.dispose()
