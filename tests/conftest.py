"""Shared fixtures: a real database (a SQLite file, and PostgreSQL when DPLEDGER_TEST_POSTGRES_URL is
set) migrated by Alembic, and the real app called in-process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, make_url, text

from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from dpledger.service.store.db import migrate

ADMIN_KEY = "test-admin-key-0123456789abcdef"
POSTGRES_URL = os.environ.get("DPLEDGER_TEST_POSTGRES_URL")
# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2), a file to a worker so that its
# module-scoped servers start once. The federations (faults/, flower/) are one unit, run one after
# another on one worker: they mostly wait (Flower's 3 s polls, a dead node's round timeout) while the
# other worker runs the in-process tests; two at once would only make each slower on two cores.
ONE_AFTER_ANOTHER = ("tests/faults/", "tests/flower/")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    # In collection order, which puts the longest units first (faults/, flower/, reliability/), not
    # xdist's default of the units with most tests first: that left the crash and load tests for last.
    config.option.loadscopereorder = False

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "federations" if path.startswith(ONE_AFTER_ANOTHER) else path

    return ByFile(config, log)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A database of this test session's own on the server DPLEDGER_TEST_POSTGRES_URL names, so
    that nothing else using that database (a bench, another run) can drop tables under a test."""
    if not POSTGRES_URL:
        pytest.skip("DPLEDGER_TEST_POSTGRES_URL is not set")
    server = make_url(POSTGRES_URL)
    name = f"dpledger_test_{os.getpid()}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    yield server.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def reset_postgres(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP SCHEMA public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/ledger.db"
    else:
        url = request.getfixturevalue("postgres_url")
        reset_postgres(url)
    migrate(url)
    return url


@pytest.fixture
def app(database_url: str):  # type: ignore[no-untyped-def]
    application = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY))
    yield application
    application.state.engine.dispose()


@pytest.fixture
def client(app) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(app) as test_client:
        yield test_client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN = bearer(ADMIN_KEY)


# The workload most of these tests charge (one DP-SGD step at q = 10/1000, σ = 1.1), declared at
# registration as a real silo would: its filter commits to the order where that workload is cheapest.
TEST_HORIZON: dict[str, object] = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}


@dataclass(frozen=True)
class SiloHandle:
    id: int
    headers: dict[str, str]
    epsilon: float
    delta: float
    dataset_size: int


@pytest.fixture
def make_silo(client: TestClient):  # type: ignore[no-untyped-def]
    counter = iter(range(1_000_000))

    def make(
        *, epsilon: float = 1.0, delta: float = 1e-5, dataset_size: int = 1000, name: str | None = None,
        horizon: dict[str, object] | None = TEST_HORIZON,
    ) -> SiloHandle:
        body = {"name": name or f"silo-{next(counter)}", "epsilon": epsilon, "delta": delta, "dataset_size": dataset_size}
        if horizon is not None:
            body["horizon"] = horizon
        response = client.post("/v1/silos", json=body, headers=ADMIN)
        assert response.status_code == 201, response.text
        data = response.json()
        return SiloHandle(data["id"], bearer(data["api_key"]), epsilon, delta, dataset_size)

    return make


@pytest.fixture(autouse=True)
def _receipts_in_tmp(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The trainer's client keeps receipts by default (in $DPLEDGER_RECEIPTS): in a temporary folder
    of the test's own, never in the home directory of whoever runs the tests, and not inside the
    test's tmp_path, whose contents some tests assert (the demo's output folder)."""
    monkeypatch.setenv("DPLEDGER_RECEIPTS", str(tmp_path_factory.mktemp("receipts")))
