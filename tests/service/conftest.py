"""Fixtures shared by the service's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpledger.service.ledger.db import migrate


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A freshly migrated SQLite ledger file."""
    database_url = f"sqlite:///{tmp_path}/ledger.db"
    migrate(database_url)
    return database_url
