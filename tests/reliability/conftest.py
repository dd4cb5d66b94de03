"""The database every reliability test runs against: a SQLite file, and PostgreSQL when
DPLEDGER_TEST_POSTGRES_URL is set (a fresh `public` schema in this session's own database)."""

from __future__ import annotations

import pytest

from tests.conftest import reset_postgres


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """Unmigrated: the server (or the test) migrates it, as an operator's first start would."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    url: str = request.getfixturevalue("postgres_url")  # skips when PostgreSQL is not configured
    reset_postgres(url)
    return url

