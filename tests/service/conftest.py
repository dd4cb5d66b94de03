"""Fixtures shared by the service's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine

from dpledger.service.store.db import migrate


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A freshly migrated SQLite ledger file."""
    database_url = f"sqlite:///{tmp_path}/ledger.db"
    migrate(database_url)
    return database_url


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """An engine of its own on the test's ledger (`database_url`), for raw SQL as an operator would run it."""
    made = create_engine(database_url)
    yield made
    made.dispose()
