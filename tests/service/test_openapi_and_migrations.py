from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from dpledger.cli import openapi_document
from dpledger.service.ledger.db import alembic_config
from dpledger.service.ledger.models import Base

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_openapi_document_is_the_one_the_app_generates() -> None:
    committed = (ROOT / "openapi" / "openapi.json").read_text()
    assert committed == openapi_document(), "openapi/ drifted from the app: run `dpledger openapi`"


def test_operation_ids_are_the_stable_route_names() -> None:
    import json

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
