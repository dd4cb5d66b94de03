"""Two processes migrate one fresh database at the same moment (`dpledger serve &` then `dpledger
keys create` in a script): both succeed and the database ends at head, once. Without the lock both
found it unversioned and both ran the first revision ("table silos already exists"). A SQLite file,
and PostgreSQL when DPLEDGER_TEST_POSTGRES_URL is set (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from dpledger.service.store.db import alembic_config
from tests.conftest import reset_postgres

# Each child imports everything first, says it is ready, then waits for the starting gun, so both
# reach migrate() together.
_CHILD = """
import sys, time
from pathlib import Path
from dpledger.service.store.db import migrate
gun = Path(sys.argv[2])
Path(sys.argv[3]).touch()
while not gun.exists():
    time.sleep(0.001)
migrate(sys.argv[1])
print("migrated")
"""


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_database(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """A function that empties the database and returns its URL."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")

        def fresh_postgres() -> str:
            reset_postgres(url)
            return url

        return fresh_postgres

    def fresh_sqlite() -> str:
        for leftover in tmp_path.glob("ledger.db*"):
            leftover.unlink()
        return f"sqlite:///{tmp_path / 'ledger.db'}"

    return fresh_sqlite


def test_two_processes_migrating_one_fresh_database_at_once_both_succeed(
    fresh_database: Callable[[], str], tmp_path: Path
) -> None:
    gun = tmp_path / "go"
    for attempt in range(3):  # the race is real each time; three draws make a lucky pass unlikely without the lock
        url = fresh_database()
        gun.unlink(missing_ok=True)
        ready = [tmp_path / f"ready-{attempt}-{k}" for k in range(2)]
        children = [
            subprocess.Popen([sys.executable, "-c", _CHILD, url, str(gun), str(flag)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for flag in ready
        ]
        deadline = time.monotonic() + 60
        while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        gun.touch()
        results = [child.communicate(timeout=120) for child in children]
        for child, (out, err) in zip(children, results, strict=True):
            assert child.returncode == 0, f"attempt {attempt}: {err.strip().splitlines()[-1:]}"
            assert out.strip() == "migrated"
        engine = create_engine(url)
        try:
            with engine.connect() as connection:
                versions = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            tables = set(inspect(engine).get_table_names())
        finally:
            engine.dispose()
        head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
        assert versions == [head]
        assert {"silos", "api_keys", "charges"} <= tables
