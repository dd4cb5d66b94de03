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
from matplotlib.figure import Figure
from sqlalchemy import event

from dpledger.cli import database_url_hint, main
from dpledger.harness import ServerProcess, free_port
from dpledger.people import commands as people_commands
from dpledger.service.api import ledger_file
from dpledger.service.api.app import create_app
from dpledger.service.api.ledger_file import LedgerInUse, hold_ledger
from dpledger.service.dashboard import pages, svg
from dpledger.service.dashboard.pages import SiloRow
from dpledger.service.serving import why_it_died
from dpledger.service.settings import Settings, get_settings
from dpledger.service.store.db import migrate
from dpledger.service.store.errors import disk_full
from dpledger.trainer import report
from dpledger.trainer.loop import JobRun, Refusal, RoundRecord
from dpledger.trainer.report import DemoSettings, epsilon_panels, plot_epsilon, refusal_point
from dpledger.wire.enums import Relation
from dpledger.wire.numbers import remaining_shown
from dpledger.wire.schemas import SiloSummary, delta_refusal
from tests.conftest import ADMIN, ADMIN_KEY

DPLEDGER = [sys.executable, "-m", "dpledger.cli"]
ROOT = Path(__file__).resolve().parent.parent


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
    first = client.post("/v1/silos", json={"name": "first", **SILO, "epsilon": 1000.0}, headers=ADMIN)
    assert first.status_code == 201
    silo_headers = {"Authorization": f"Bearer {first.json()['api_key']}"}
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
    # An approval too (the group commit's path): 503, its charge not reserved.
    step = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}
    charged = []
    for i in range(40):
        charged.append(client.post(f"/v1/silos/{first.json()['id']}/charges",
                                   json={"idempotency_key": f"k{i}", "mechanism": step}, headers=silo_headers))
        if charged[-1].status_code != 201:
            break
    assert charged[-1].status_code == 503 and charged[-1].json()["detail"].startswith("the ledger's disk is full")
    event.remove(engine, "connect", _cap)
    engine.dispose()
    # Nothing half-written: exactly the silos and charges answered 201, and every chain still recomputes.
    assert len(client.get("/v1/silos", headers=ADMIN).json()) == 1 + created
    reserved = client.get(f"/v1/silos/{first.json()['id']}/charges", headers=ADMIN).json()
    assert isinstance(reserved, list) and len(reserved) == sum(c.status_code == 201 for c in charged)
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


# --- pictures that do not mislead -------------------------------------------------------------------------------


def _run(refused_at: int, *, spent: list[float], would_reach: float | None) -> JobRun:
    """Two silos, three rounds: silo 0 trains every round, silo 1 is refused at round `refused_at` (from 0)."""
    rounds = [RoundRecord(round_index=r, approved=[True, r < refused_at], refused=[False, r == refused_at],
                          epsilon_spent=[spent[r], spent[min(r, refused_at - 1)]], metric=[0.5, 0.5],
                          update_norms=[1.0, 1.0]) for r in range(3)]
    refusal = Refusal(round_index=refused_at, budget=2.0, epsilon_spent=spent[refused_at - 1],
                      epsilon_if_approved=would_reach)
    return JobRun(job_id="j", rounds=rounds, stopped=[False, True], refusals={1: refusal})


def _settings(rounds: int = 3) -> DemoSettings:
    return DemoSettings(silos=2, rounds=rounds, seed=0, budgets="ladder", epsilons=[8.0, 2.0], delta=1e-5,
                        noise_multipliers=[1.1, 1.1], calibrated=False, sampling_rates=[0.02, 0.02],
                        dataset_sizes=[800, 800], batch_size=16, local_steps=10, lr=0.1, clip_norm=1.0, lam=0.01,
                        mask_probability=0.0, n_classes=10, device="cpu")


def test_a_refusal_is_drawn_at_the_epsilon_its_round_would_reach_above_the_budget() -> None:
    run = _run(2, spent=[0.9, 1.7, 2.4], would_reach=2.45)
    assert refusal_point(run, 1) == (3, 2.45)  # round 3 (from 1), above the budget 2.0, not at the 1.7 spent
    assert refusal_point(run, 0) is None
    beyond = _run(2, spent=[0.9, 1.7, 2.4], would_reach=None)  # the API's null: beyond every RDP order
    assert refusal_point(beyond, 1) == (3, 2.0)


def test_algorithms_that_spend_the_same_epsilon_share_one_panel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    same = {name: _run(2, spent=[0.9, 1.7, 2.4], would_reach=2.45) for name in ("local", "fedavg", "mrmtl")}
    panels = epsilon_panels(same, 2)
    assert [title for title, _ in panels] == ["local, fedavg, mrmtl (the same ε)"]
    other = {**same, "mrmtl": _run(1, spent=[0.9, 1.7, 2.4], would_reach=2.1)}
    assert [title for title, _ in epsilon_panels(other, 2)] == ["local, fedavg (the same ε)", "mrmtl"]

    drawn: list[Figure] = []
    monkeypatch.setattr(report.plt, "close", drawn.append)  # the figure as saved, kept to be read back
    plot_epsilon(tmp_path / "epsilon.png", same, _settings())
    assert (tmp_path / "epsilon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (figure,) = drawn
    (panel,) = [axis for axis in figure.axes if axis.get_title()]  # the colour bar's axis has no title
    assert panel.get_title() == "local, fedavg, mrmtl (the same ε)"
    crosses = [line for line in panel.get_lines() if line.get_marker() == "x" and len(line.get_xdata()) == 1]
    assert [(line.get_xdata()[0], line.get_ydata()[0]) for line in crosses] == [(3, 2.45)]
    low, high = panel.get_ylim()
    assert low == 0.0 and high >= 2.45 * 1.08 - 1e-12  # the cross is inside the picture, above the 2.0 budget line


@pytest.mark.parametrize(("spent", "state", "colour"), [
    (0.59 * 4, "fine", "#1e8449"), (0.8 * 4, "near", "#d68910"), (3.9, "near", "#d68910"),
    (4 - 1.75309e-08, "exhausted", "#c0392b"), (4.0, "exhausted", "#c0392b"), (math.inf, "exhausted", "#c0392b"),
])
def test_the_dashboard_bar_separates_fine_near_and_exhausted(spent: float, state: str, colour: str) -> None:
    drawn = svg.bar(spent=spent, budget=4.0)
    assert f'data-state="{state}"' in drawn and f'class="bar-spent" width="{round(min(spent / 4, 1.0) * 160.0, 2)}"' in drawn
    assert f'fill="{colour}"' in drawn


def test_an_exhausted_silo_shows_exhausted_not_a_float_residue() -> None:
    row = SiloRow(id=1, name="clinic-b", epsilon=4.0, delta=1e-5, epsilon_spent=4 - 1.75309e-08,
                  epsilon_committed=4 - 1.75309e-08, epsilon_remaining=1.75309e-08)
    shown_row = pages._silo_row(row)
    assert 'data-epsilon-remaining="1.75309e-08">exhausted</td>' in shown_row and ">1.75309e-08<" not in shown_row
    assert remaining_shown(remaining=0.5, budget=4.0) == "0.5"
    live = SiloSummary(id=1, name="b", epsilon=4.0, delta=1e-5, dataset_size=674, relation=Relation.add_remove,
                       epsilon_spent=4 - 1.75309e-08)
    assert people_commands.state(live) == "exhausted"
    assert people_commands.state(live.model_copy(update={"epsilon_spent": 1.0})) == "in service"
    assert people_commands.state(live.model_copy(update={"retired_seq": 7})) == "retired at entry 7"


# --- the smaller frictions --------------------------------------------------------------------------------------


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ended:
        main([*argv, "--help"])
    assert ended.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone


def test_silos_create_help_asks_for_an_admin_key(capsys: pytest.CaptureFixture[str]) -> None:
    said = _help(["silos", "create"], capsys)
    assert "DPLEDGER_KEY, which must be an admin key" in said and "a reader's API key" not in said
    assert "refuses a δ at or above 1/dataset-size" in said


def test_the_top_level_help_speaks_to_a_user(capsys: pytest.CaptureFixture[str]) -> None:
    said = _help([], capsys)
    for internal in ("worker_cli", "Service commands live here", "never loads torch", "imported only when"):
        assert internal not in said
    assert said.count("dpledger: a privacy ledger for cross-silo federated learning.") == 1
    assert "DPLEDGER_URL" in said and "DATABASE_URL" in said


@pytest.mark.parametrize(("argv", "says"), [
    (["pubkey"], "Prints the Ed25519 public key that signs the ledger's transparency-log heads"),
    (["audit"], "that the log only grew since the head saved in HEAD_FILE"),
    (["keys"], "Writes to the database DATABASE_URL names (migrating it first), not over HTTP"),
    (["keys", "create"], "the database keeps only the key's SHA-256"),
])
def test_pubkey_audit_and_keys_say_what_they_do(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert says in _help(argv, capsys)


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_a_postgres_url_without_our_driver_gets_the_url_to_write(scheme: str, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DATABASE_URL", f"{scheme}://ledger:s3cret@db.example:5432/ledger")
    get_settings.cache_clear()
    try:
        assert main(["migrate"]) == 2
    finally:
        get_settings.cache_clear()
    said = capsys.readouterr().err
    assert said == (f"dpledger migrate: DATABASE_URL starts {scheme}://, which names a driver dpledger does not "
                    "install: write it as postgresql+psycopg://…@db.example:5432/ledger (psycopg 3, the `postgres` "
                    "extra: pip install 'dpledger[postgres]')\n")
    assert database_url_hint("postgresql+psycopg://postgres@127.0.0.1:5432/test") is None


def test_history_csv_counts_rounds_from_one_and_keeps_the_rest() -> None:
    page = "seq,job_id,round,hash\r\n1,,,aa\r\n2,job,0,bb\r\n3,\"a,b\",19,cc\r\n"
    assert people_commands.rounds_from_one(page) == "seq,job_id,round,hash\r\n1,,,aa\r\n2,job,1,bb\r\n3,\"a,b\",20,cc\r\n"


def test_the_readme_prose_names_the_ledger_by_its_url_not_port_8000() -> None:
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("<!-- --8<-- [start:tour] -->", 1)[1].split("<!-- --8<-- [end:tour] -->", 1)[0]
    prose = tour.split("```", 2)[2]  # after the block, where PORT may have been set
    assert "127.0.0.1:8000" not in prose and "`$DPLEDGER_URL/dashboard`" in prose


# --- guides that start with the example -------------------------------------------------------------------------


def _before_python_blocks(page: str) -> list[str]:
    """The paragraph right above each ```python block of a page (its HTML comments left out)."""
    parts = (ROOT / page).read_text().split("```python\n")[:-1]
    above = ["\n".join(line for line in part.splitlines() if not line.startswith("<!--")).strip() for part in parts]
    return [text.rsplit("\n\n", 1)[-1] for text in above]


def test_each_silo_example_is_preceded_by_what_it_needs() -> None:
    plain, opacus = _before_python_blocks("docs/guides/silo.md")[:2]
    for needs in ("--dataset-size 1797", "DPLEDGER_URL", "DPLEDGER_KEY", "DPLEDGER_SILO"):
        assert needs in plain
    assert "`opacus` extra" in opacus and "1,797 records" in opacus
    assert all(len(p.splitlines()) <= 2 for p in (plain, opacus))  # a two-line preamble, the rest after the block


def test_the_consortium_page_opens_with_its_block() -> None:
    page = (ROOT / "docs" / "guides" / "consortium.md").read_text()
    before = page.split("<!-- federation-block: begin -->", 1)[0]
    prose = [line for line in before.splitlines() if line and not line.startswith(("#", "<!--"))]
    assert len(prose) == 2 and "`flower` extra" in prose[0]


def test_the_gate_pages_mathematics_is_rendered_without_any_script() -> None:
    page = (ROOT / "docs" / "concepts" / "gate.md").read_text()
    for plain_text in ("α_1", "α_i", "w_i", "w_1", "e^ε", ".."):
        assert plain_text not in page.split("\n- **Which orders.**", 1)[0], plain_text
    assert "α<sub>1</sub>, …, α<sub>m</sub>" in page and "δ·w<sub>i</sub>" in page and "e<sup>ε</sup>" in page
    site = (ROOT / "mkdocs.yml").read_text()
    assert "extra_javascript" not in site and "mathjax" not in site.lower() and "katex" not in site.lower()


class _Child:
    """A worker process as uvicorn's supervisor sees it: its multiprocessing process and its health check."""

    def __init__(self, pid: int, *, exitcode: int | None = None, answers: bool = True) -> None:
        self.pid, self.answers, self.killed, self.pings = pid, answers, False, 0
        self.process = self
        self.exitcode = exitcode

    def is_alive(self, timeout: float | None = None) -> bool:
        running = self.exitcode is None and not self.killed
        if timeout is None:
            return running
        self.pings += running  # with a timeout: uvicorn's ping too (of a process that runs)
        return running and self.answers

    def kill(self) -> None:
        if self.exitcode is None:
            self.killed, self.exitcode = True, -9

    def join(self) -> None:
        pass


def test_the_supervisor_says_why_each_worker_it_replaces_ended(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import threading
    from types import SimpleNamespace

    from uvicorn.supervisors import multiprocess

    from dpledger.service import serving

    started: list[object] = []

    class Replacement(_Child):
        def __init__(self, *_: object) -> None:
            super().__init__(100 + len(started))

        def start(self) -> None:
            started.append(self)

    monkeypatch.setattr(multiprocess, "Process", Replacement)
    supervisor = object.__new__(serving._Supervisor)
    supervisor.should_exit = threading.Event()
    # The one setting its loop reads (a uvicorn.Config would configure uvicorn's logging, out of caplog's reach).
    supervisor.config = SimpleNamespace(timeout_worker_healthcheck=60)  # type: ignore[assignment]
    supervisor.target, supervisor.sockets = None, []  # type: ignore[assignment]
    healthy, crashed, hung, oom = _Child(11), _Child(12, exitcode=3), _Child(13, answers=False), _Child(14, exitcode=-9)
    supervisor.processes = [healthy, crashed, hung, oom]  # type: ignore[list-item]
    with caplog.at_level("INFO", logger="uvicorn.error"):
        supervisor.keep_subprocess_alive()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker process")]
    assert [r.getMessage() for r in caplog.records if "Child process" in r.getMessage()] == [
        "Child process [12] died", "Child process [13] died", "Child process [14] died"]  # uvicorn's, after ours
    assert said == [
        "worker process [12] exited with status 3 (its error is logged above); starting another",
        "worker process [13] did not answer the supervisor's health check within 60 s (hung or starved of CPU): "
        "killed; starting another",
        "worker process [14] was killed by SIGKILL (by the kernel's out-of-memory killer, or an operator); starting another",
    ]
    assert hung.killed and not healthy.killed
    assert supervisor.processes[0] is healthy and len(started) == 3  # uvicorn's own loop replaced the three
    assert [p.pid for p in supervisor.processes] == [11, 100, 101, 102]  # each in the place of the one it replaced
    # A worker is pinged once a check (uvicorn's loop, given the ended ones alone, pings no other), and
    # the supervisor's loop, every 0.5 s, checks again only WORKER_CHECK_S later.
    assert healthy.pings == 1
    supervisor.keep_subprocess_alive()
    assert healthy.pings == 1
    supervisor._next_check = 0.0
    supervisor.keep_subprocess_alive()
    assert healthy.pings == 2 and len(started) == 3


def test_a_server_does_not_start_beside_workers_its_killed_predecessor_left(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    # A serving process whose supervisor is gone: it holds the workers' shared lock, not the server's.
    orphan = subprocess.Popen([sys.executable, "-c", "import sys, time; from dpledger.service.api.ledger_file import "
                               f"join_ledger; join_ledger({url!r}); print('serving', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert orphan.stdout is not None and orphan.stdout.readline() == "serving\n"
        with pytest.raises(LedgerInUse, match="worker processes of an earlier dpledger server still serve"):
            hold_ledger(url)
    finally:
        orphan.kill()
        orphan.wait()
    hold_ledger(url)  # once they are gone
    ledger_file._held.pop(str(tmp_path / "ledger.db")).close()
