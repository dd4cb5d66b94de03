"""The small frictions a newcomer met (issue 28): a closed pipe, `verify --receipts` without a folder,
a quoted number in a job file, rounds counted from 0 in one line and from 1 elsewhere, and the
PostgreSQL block of the README that left out production's signing key. Against a real server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dpledger.cli import EXIT_CLOSED_PIPE, main
from dpledger.harness import free_port, running_server
from dpledger.trainer.silo.rounds import refusal_line
from dpledger.wire.client import LedgerClient
from dpledger.wire.errors import Denied
from tests.conftest import ADMIN, ADMIN_KEY

ROOT = Path(__file__).resolve().parent.parent
README_ADMIN_KEY = "readme-postgres-admin-key-0123456789"
STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(database_url=f"sqlite:///{tmp_path_factory.mktemp('frictions')}/l.db", admin_key=ADMIN_KEY) as url:
        yield url


def silo(url: str, name: str) -> tuple[int, str]:
    body = {"name": name, "epsilon": 8.0, "delta": 1e-5, "dataset_size": 1000}
    created = httpx.post(f"{url}/v1/silos", json=body, headers=ADMIN)
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["api_key"]


def test_history_into_a_closed_pipe_ends_quietly(ledger: str) -> None:
    silo_id, key = silo(ledger, "piped")
    with LedgerClient(ledger, key, receipts=False) as client:
        for i in range(3):
            client.reserve(silo_id, mechanism=STEP, idempotency_key=f"p{i}", job_id="pipe", round=i)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line, as `| head` is after its tenth
    env = {**os.environ, "DPLEDGER_URL": ledger, "DPLEDGER_KEY": ADMIN_KEY}
    done = subprocess.run([sys.executable, "-m", "dpledger.cli", "history", str(silo_id)], stdout=write,
                          stderr=subprocess.PIPE, env=env, cwd=ROOT, timeout=60)
    os.close(write)
    assert done.stderr.decode() == ""  # no BrokenPipeError traceback, no "Exception ignored" line
    assert done.returncode == EXIT_CLOSED_PIPE == 128 + signal.SIGPIPE


def test_verify_receipts_without_a_folder_reads_where_the_client_keeps_them(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DPLEDGER_URL", ledger)
    monkeypatch.setenv("DPLEDGER_KEY", ADMIN_KEY)
    folder = tmp_path / "kept"
    monkeypatch.setenv("DPLEDGER_RECEIPTS", str(folder))
    assert main(["verify", "--receipts"]) == 2
    said = capsys.readouterr().err
    assert said == f"dpledger: no receipts at {folder}: the trainer's client keeps them in $DPLEDGER_RECEIPTS\n"

    silo_id, key = silo(ledger, "receipted")
    with LedgerClient(ledger, key) as client:  # receipts=True: the default folder, $DPLEDGER_RECEIPTS
        charge = client.reserve(silo_id, mechanism=STEP, idempotency_key="r0", job_id="receipts", round=0)
        client.commit(charge.charge_id)
    assert main(["verify", "--receipts"]) == 0
    assert re.fullmatch(r"ok: 2 receipts, \d+ distinct heads? and \d+ entries of silo \d+ against the head of size (\d+)\n"
                        rf"ok: kept the head of size \1 in {re.escape(str(folder))}/ledger-[0-9a-f]{{16}}/head.json"
                        r"(, \d receipts completed)?\n", capsys.readouterr().out)


def test_a_quoted_number_in_the_job_file_is_one_line_and_spends_nothing(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    silo_id, key = silo(ledger, "quoted")
    monkeypatch.setenv("QUOTED_KEY", key)
    job = tmp_path / "job.toml"
    job.write_text(f'url = "{ledger}"\njob_id = "quoted"\nrounds = "20"\n[data]\nsilos = 1\n[dpsgd]\nlr = "0.5"\n'
                   f'[[silos]]\nid = {silo_id}\nkey_env = "QUOTED_KEY"\n')
    assert main(["train", str(job), "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dpledger train: {job}: rounds: must be an integer, not the string '20' (write it without quotes: rounds = 20)",
        f"dpledger train: {job}: dpsgd.lr: must be a number, not the string '0.5' (write it without quotes: lr = 0.5)",
    ]
    history = httpx.get(f"{ledger}/v1/silos/{silo_id}/history", headers=ADMIN).json()
    assert [e["event"] for e in history] == ["create"]  # nothing reserved
    job.write_text(job.read_text().replace('rounds = "20"', "rounds = 20.0").replace('lr = "0.5"', "lr = 1"))
    assert main(["train", str(job), "--no-progress"]) == 2  # a float is not a count; an integer is a number
    assert capsys.readouterr().err.splitlines() == [f"dpledger train: {job}: rounds: must be an integer, not 20.0 (a float)"]


def test_a_refusal_names_its_round_counted_from_1() -> None:
    denied = Denied(epsilon=3.0, epsilon_spent=2.5, epsilon_if_approved=3.25, detail="over budget")
    # The ledger's index 16 is the 17th round, as the progress bar and the plots count it.
    assert refusal_line(denied, round=16) == "round 17 refused: it needs ε 3.25 in all; the budget is 3.00 and 2.50 is spent"


def test_the_readmes_postgresql_block_starts_a_production_ledger(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The block as written, with the placeholders filled (a SQLite file stands in for the server
    unless DPLEDGER_TEST_POSTGRES_URL names one: then a database of this session's own on it, not
    one a bench or another run may have left at another revision) and the serve line in the background."""
    readme = (ROOT / "docs" / "guides" / "operator.md").read_text()
    heading = "## Running on PostgreSQL with several workers\n\n<!-- runs-in: tests/test_newcomer_frictions.py -->\n```\n"
    block = readme.split(heading, 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if not line.startswith("pip install")]  # installed already
    port = free_port()
    database = (request.getfixturevalue("postgres_url") if os.environ.get("DPLEDGER_TEST_POSTGRES_URL")
                else f"sqlite:///{tmp_path}/ledger.db")
    script = "\n".join(lines)
    script = re.sub(r"DATABASE_URL=\S+", f"DATABASE_URL={database}", script)
    script = script.replace("DPLEDGER_ADMIN_KEY=...", f"DPLEDGER_ADMIN_KEY={README_ADMIN_KEY}")
    serving = f"--host 127.0.0.1 --port {port} --workers 2 > serve.log 2>&1 &"
    script = script.replace("--host 0.0.0.0 --port 8000 --workers 4", serving)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPLEDGER_", "DATABASE_URL"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    script = f"set -e\n{script}\necho $! > serve.pid\ndpledger wait http://127.0.0.1:{port}/healthz --timeout 60\n"
    try:
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{done.stderr}{(tmp_path / 'serve.log').read_text()}"
        admin = {"Authorization": f"Bearer {README_ADMIN_KEY}"}
        key = httpx.get(f"http://127.0.0.1:{port}/v1/log/public-key", headers=admin).json()
        assert key["public_key"] == _public_key_hex(tmp_path / "log.pem")  # signed with the block's key
    finally:
        pid = tmp_path / "serve.pid"
        if pid.exists():
            os.kill(int(pid.read_text()), signal.SIGTERM)


def _public_key_hex(pem: Path) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_private_key

    private = load_pem_private_key(pem.read_bytes(), password=None)
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def test_a_database_a_newer_dpledger_migrated_is_named_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`dpledger migrate` on a database at a revision it does not have (a newer version's) says so in
    one line and exit 2, where Alembic raised a 40-line traceback, and writes nothing."""
    import sqlite3

    url = f"sqlite:///{tmp_path}/ledger.db"
    monkeypatch.setenv("DATABASE_URL", url)
    assert main(["migrate"]) == 0
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        db.execute("UPDATE alembic_version SET version_num = '9999'")
    capsys.readouterr()
    assert main(["migrate"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "dpledger migrate: the database (DATABASE_URL) is at a revision this dpledger does not have ('9999'): a newer "
        "dpledger migrated it; run that version, or point DATABASE_URL at another database"]
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999",)]
