"""What a new user met in the first hour (issue 45): a δ that cannot be a guarantee, a second server
on one ledger, a database file gone under a running server, a full disk, and the CLI's texts."""

from __future__ import annotations

import errno
import math
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from dpledger.harness import ServerProcess, free_port
from dpledger.service.api import ledger_file
from dpledger.service.api.app import create_app
from dpledger.service.api.errors import disk_full
from dpledger.service.api.ledger_file import hold_ledger
from dpledger.service.ledger.db import migrate
from dpledger.service.serving import why_it_died
from dpledger.service.settings import Settings
from dpledger.wire.schemas import delta_refusal
from tests.conftest import ADMIN, ADMIN_KEY

DPLEDGER = [sys.executable, "-m", "dpledger.cli"]


@pytest.mark.parametrize(("delta", "size"), [(0.01, 674), (1 / 674, 674), (1e-5, 100_000), (0.5, 2)])
def test_delta_at_or_above_one_over_n_is_a_422_naming_delta_and_the_bound(client, delta, size) -> None:
    body = {"name": "hospital", "epsilon": 4.0, "delta": delta, "dataset_size": size}
    response = client.post("/v1/silos", json=body, headers=ADMIN)
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "delta"]
    assert f"1/dataset_size = 1/{size} = {1 / size:.3g}" in error["msg"]
    assert client.get("/v1/silos", headers=ADMIN).json() == []  # nothing written


def test_delta_just_below_one_over_n_is_accepted(client) -> None:
    # 1e-5 · 99_999 < 1: the largest set 1e-5 still suits.
    body = {"name": "hospital", "epsilon": 4.0, "delta": 1e-5, "dataset_size": 99_999}
    assert client.post("/v1/silos", json=body, headers=ADMIN).status_code == 201


def test_a_levels_delta_is_held_to_the_silos_size(client) -> None:
    assert client.post("/v1/levels", json={"name": "loose", "epsilon": 1.0, "delta": 1e-3}, headers=ADMIN).status_code == 201
    refused = client.post("/v1/silos", json={"name": "s", "level": "loose", "dataset_size": 5000}, headers=ADMIN)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "level"]
    assert "1/5000" in refused.json()["detail"][0]["msg"]
    fits = client.post("/v1/silos", json={"name": "s", "level": "loose", "dataset_size": 999}, headers=ADMIN)
    assert fits.status_code == 201


def test_the_suggested_delta_is_below_one_over_a_hundred_n() -> None:
    for size in (2, 674, 1797, 60_000, 10**9):
        said = delta_refusal(1.0 - 1e-9, size)
        assert said is not None
        suggested = float(said.rsplit("e.g. ", 1)[1].rstrip(")"))
        assert suggested <= min(1e-5, 1 / (100 * size))
        assert suggested == 1e-5 or suggested > 1 / (1000 * size)  # the largest such power of ten
        assert math.log10(suggested) == round(math.log10(suggested))  # a power of ten


def test_a_second_server_on_one_sqlite_ledger_is_refused_in_one_line_until_the_first_dies(tmp_path: Path) -> None:
    database = tmp_path / "ledger.db"
    server = ServerProcess(database_url=f"sqlite:///{database}", admin_key=ADMIN_KEY)
    server.start()
    try:
        assert server.process is not None
        env = {**os.environ, "DATABASE_URL": f"sqlite:///{database}", "DPLEDGER_ADMIN_KEY": ADMIN_KEY}
        second = subprocess.run([*DPLEDGER, "serve", "--port", str(free_port())], env=env, capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 2
        assert second.stderr.count("\n") == 1 and second.stdout == ""
        assert f"another dpledger server (pid {server.process.pid}) serves {database}" in second.stderr
    finally:
        server.kill()  # SIGKILL: no clean-up runs, and the kernel drops the lock all the same
    hold_ledger(f"sqlite:///{database}")  # as the next `serve` takes it
    ledger_file._held.pop(str(database)).close()


@pytest.fixture
def sqlite_client(tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    database = tmp_path / "ledger.db"
    migrate(f"sqlite:///{database}")
    app = create_app(Settings(database_url=f"sqlite:///{database}", admin_key=ADMIN_KEY))
    with TestClient(app) as client:
        yield client, database
    app.state.engine.dispose()


SILO = {"epsilon": 4.0, "delta": 1e-5, "dataset_size": 674}


def test_a_ledger_file_removed_or_replaced_under_the_server_stops_it_answering(sqlite_client) -> None:
    client, database = sqlite_client
    assert client.post("/v1/silos", json={"name": "a", **SILO}, headers=ADMIN).status_code == 201
    moved = database.with_name("moved.db")
    os.rename(database, moved)
    for answer in (client.get("/healthz"), client.post("/v1/silos", json={"name": "b", **SILO}, headers=ADMIN),
                   client.get("/v1/silos", headers=ADMIN)):
        assert answer.status_code == 503
        assert answer.json() == {"detail": f"the ledger's database file {database} was removed while this server "
                                 "ran: nothing it writes would be found again; restore the file (or a backup) and "
                                 "restart the server"}
    assert client.get("/metrics").status_code == 200  # the operator still sees the server
    os.rename(moved, database)  # the same file back under its name: served again, "b" was never written
    assert client.get("/healthz").status_code == 200
    assert [s["name"] for s in client.get("/v1/silos", headers=ADMIN).json()] == ["a"]
    shutil.copy(database, moved)
    os.replace(moved, database)  # a copy, as a restore from backup puts it: another file
    replaced = client.post("/v1/silos", json={"name": "c", **SILO}, headers=ADMIN)
    assert replaced.status_code == 503 and "was replaced while this server ran" in replaced.json()["detail"]
    assert client.get("/healthz").status_code == 503


def test_disk_full_is_a_503_that_says_so_and_writes_nothing(sqlite_client) -> None:
    client, database = sqlite_client
    engine = client.app.state.engine  # type: ignore[attr-defined]
    assert client.post("/v1/silos", json={"name": "first", **SILO}, headers=ADMIN).status_code == 201
    pages = sqlite3.connect(database).execute("PRAGMA page_count").fetchone()[0]

    # SQLite's own "database or disk is full" (SQLITE_FULL), as a full disk raises it: no page beyond these.
    @event.listens_for(engine, "connect")
    def _cap(connection, _record) -> None:  # type: ignore[no-untyped-def]
        connection.execute(f"PRAGMA max_page_count = {pages}")

    engine.dispose()  # every connection from now on is capped
    answers = []
    for i in range(40):
        answers.append(client.post("/v1/silos", json={"name": f"s{i}", **SILO}, headers=ADMIN))
        if answers[-1].status_code != 201:
            break
    full = [a for a in answers if a.status_code != 201]
    assert full, "the cap never filled the file"
    assert {a.status_code for a in full} == {503}
    assert full[0].json()["detail"].startswith("the ledger's disk is full: nothing of this request was written")
    created = sum(a.status_code == 201 for a in answers)
    event.remove(engine, "connect", _cap)
    engine.dispose()
    # Nothing half-written: exactly the silos answered 201, and every chain still recomputes.
    assert len(client.get("/v1/silos", headers=ADMIN).json()) == 1 + created
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


def test_disk_full_is_recognised_however_the_driver_says_it() -> None:
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    wrapped = RuntimeError("the group failed")
    wrapped.__cause__ = sqlite3.OperationalError("database or disk is full")
    assert disk_full(wrapped)
    assert not disk_full(sqlite3.OperationalError("database is locked"))


def test_a_replaced_worker_is_said_why() -> None:
    assert why_it_died(None, timeout=60) == ("did not answer the supervisor's health check within 60 s (hung or "
                                             "starved of CPU): killed")
    assert why_it_died(-9, timeout=5).startswith("was killed by SIGKILL (by the kernel's out-of-memory killer")
    assert why_it_died(-15, timeout=5) == "was killed by SIGTERM"
    assert why_it_died(3, timeout=5) == "exited with status 3 (its error is logged above)"
