"""Interrupt and resume, exactly once: a real `dpledger train` process stopped at a point of a round
(SIGINT, SIGTERM or SIGKILL, held there by trainer/pause.py's file barrier), then `--resume`. Every
round is trained once per charge, each round whose charge was committed is neither charged nor
trained again, the interrupted round pays once more only where it may have read data, and the final
models are bitwise those of an uninterrupted run (the checkpoint holds every random stream)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dpledger.harness import running_server
from dpledger.trainer.pause import ENV as PAUSE
from dpledger.trainer.resume import Charge, reconcile
from dpledger.wire.enums import ChargeStatus
from dpledger.worker_cli import main
from tests.conftest import ADMIN, ADMIN_KEY
from tests.gate_oracle import dpsgd_epsilon

ROUNDS, AT = 3, 2  # a 3-round job, stopped in its round 2 (as train counts rounds, from 1)
SIGMA, STEPS, DELTA, Q = 1.5, 2, 1e-5, 16 / 674  # each round: dpsgd(q = 16/674, σ = 1.5, 2 steps)
names = count()


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(database_url=f"sqlite:///{tmp_path_factory.mktemp('resume')}/l.db", admin_key=ADMIN_KEY) as url:
        yield url


def job_file(path: Path, url: str, silo_ids: list[int], job_id: str) -> Path:
    # MR-MTL: the server's mean and every silo's model and random streams must all come back.
    path.write_text(
        f'url = "{url}"\njob_id = "{job_id}"\nalgorithm = "mrmtl"\nlam = 0.5\nrounds = {ROUNDS}\n'
        f"[data]\nsilos = 2\n[dpsgd]\nnoise_multiplier = {SIGMA}\nbatch_size = 16\nlocal_steps = {STEPS}\n"
        + "".join(f'[[silos]]\nid = {i}\nkey_env = "KEY_{k}"\n' for k, i in enumerate(silo_ids))
    )
    return path


def silos(url: str, env: dict[str, str] | None = None) -> list[int]:
    ids = []
    for k in range(2):
        body = {"name": f"resume-{next(names)}", "epsilon": 100.0, "delta": DELTA, "dataset_size": 674}
        created = httpx.post(f"{url}/v1/silos", json=body, headers=ADMIN).json()
        ids.append(created["id"])
        os.environ[f"KEY_{k}"] = created["api_key"]  # restored by the monkeypatch of each test
        if env is not None:
            env[f"KEY_{k}"] = created["api_key"]
    return ids


def charges(url: str, silo_id: int, job_id: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = httpx.get(f"{url}/v1/silos/{silo_id}/charges", headers=ADMIN).json()
    return sorted((c for c in listed if c["job_id"] == job_id), key=lambda c: c["charge_id"])


def models(out: Path) -> dict[str, Any]:
    saved: dict[str, Any] = torch.load(out / "models.pt")
    return saved


@pytest.fixture(scope="module")
def reference(ledger: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job run through without a stop (in this process): the models to match."""
    folder = tmp_path_factory.mktemp("reference")
    saved = dict(os.environ)
    try:
        ids = silos(ledger)
        job = job_file(folder / "job.toml", ledger, ids, "reference")
        assert main(["train", str(job), "--out", str(folder / "out"), "--no-progress"]) == 0
        body = httpx.get(f"{ledger}/v1/silos/{ids[0]}", headers=ADMIN).json()
        return {"models": models(folder / "out"), "epsilon_spent": body["epsilon_spent"]}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def wait_for(ready: Path, alive: Callable[[], object]) -> None:
    deadline = time.monotonic() + 120
    while not ready.exists():
        alive()
        assert time.monotonic() < deadline, "the worker never reached the point"
        time.sleep(0.05)


def stop_process(job: Path, out: Path, point: str, stop: signal.Signals, env: dict[str, str],
                 ready: Path) -> tuple[int, str]:
    """`dpledger train` in a process of its own, held at `point` of round AT, then sent `stop`."""
    code = "import sys; from dpledger.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**env, PAUSE: f"{point}:{AT}:{ready}"}
    process = subprocess.Popen([sys.executable, "-c", code, "train", str(job), "--out", str(out), "--no-progress"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def alive() -> None:
        assert process.poll() is None, process.communicate()

    wait_for(ready, alive)
    process.send_signal(stop)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def stop_here(job: Path, out: Path, point: str, stop: signal.Signals, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str], ready: Path) -> tuple[int, str]:
    """The same in this process (torch is loaded once): a real signal, sent to this process by a
    thread once the worker holds at the point (Python runs the handler in the main thread)."""
    monkeypatch.setenv(PAUSE, f"{point}:{AT}:{ready}")
    sender = threading.Thread(target=lambda: (wait_for(ready, lambda: None), os.kill(os.getpid(), stop)))
    sender.start()
    try:
        code = main(["train", str(job), "--out", str(out), "--no-progress"])
    finally:
        sender.join()
        monkeypatch.delenv(PAUSE)
    return code, capsys.readouterr().err


# A process of its own where the process matters (a KeyboardInterrupt in a real worker; a SIGKILL that
# settles nothing); the other points in this process, with real signals, to keep the file cheap.
@pytest.mark.parametrize(("point", "stop", "own_process"), [
    pytest.param(point, stop, own, id=f"{point}-{stop.name}") for point, stop, own in [
        ("before-reserve", signal.SIGINT, False), ("after-reserve", signal.SIGTERM, False),
        ("mid-training", signal.SIGINT, True), ("after-commit", signal.SIGTERM, False),
        ("mid-training", signal.SIGKILL, True),
    ]
])
def test_a_job_stopped_anywhere_resumes_exactly_once(
    ledger: str, reference: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], point: str, stop: signal.Signals, own_process: bool,
) -> None:
    env = dict(os.environ)
    for k in range(2):
        monkeypatch.delenv(f"KEY_{k}", raising=False)
    ids = silos(ledger, env)
    job_id = f"stopped-{point}-{stop.name}"
    job, out = job_file(tmp_path / "job.toml", ledger, ids, job_id), tmp_path / "out"
    if own_process:
        returncode, err = stop_process(job, out, point, stop, env, tmp_path / "ready")
    else:
        returncode, err = stop_here(job, out, point, stop, monkeypatch, capsys, tmp_path / "ready")
    at = [charges(ledger, i, job_id) for i in ids]
    in_round = [c["charge_id"] for cs in at for c in cs if c["round"] == AT - 1]
    again = f"continue with dpledger train {job} --out {out} --no-progress --resume"
    read = point == "mid-training"
    if stop is signal.SIGKILL:
        assert returncode == -signal.SIGKILL
        # Nothing settled the round: its charges stay reserved (spent) and a plain re-run says so.
        assert [c["status"] for cs in at for c in cs if c["round"] == AT - 1] == ["reserved", "reserved"]
        assert main(["train", str(job), "--out", str(out), "--no-progress"]) == 2
        refusals = capsys.readouterr().err.splitlines()
        assert refusals == [
            f"dpledger train: silos[{k}] (id {i}): silo {i} ({name}) already has charges of job_id {job_id!r} (rounds 1–{AT}); "
            f"open reservations: charge {cs[-1]['charge_id']} (round {AT}): continue that run with --resume "
            "(or resume = true), or give this run a new job_id"
            for k, (i, cs, name) in enumerate(zip(ids, at, [_name(ledger, i) for i in ids], strict=True))
        ]
    else:
        assert returncode == 130 and "Traceback" not in err
        listed = ", ".join(str(i) for i in in_round)
        expected = {
            "before-reserve": f"interrupted after round {AT - 1}: every charge of it settled",
            "after-reserve": f"interrupted in round {AT}: charges {listed} released (the round had not read data)",
            "mid-training": f"interrupted in round {AT}: charges {listed} committed (the round had read data)",
            "after-commit": f"interrupted after round {AT}: every charge of it settled",
        }[point]
        assert err.splitlines()[-1] == f"dpledger train: {expected}; {again}"
        # The folder holds the rounds completed, and the summary says why it stopped.
        done = AT if point == "after-commit" else AT - 1
        rounds = sorted({json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()})
        assert rounds == list(range(1, done + 1))
        assert json.loads((out / "summary.json").read_text())["stop_reason"].startswith("interrupted in round")

    capsys.readouterr()
    resume = ["--resume"]
    if point == "after-commit":  # the job file's spelling of the same switch
        job.write_text("resume = true\n" + job.read_text())
        resume = []
    assert main(["train", str(job), "--out", str(out), "--no-progress", *resume]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "resuming job" in line or "spent (" in line]
    completed = AT if point == "after-commit" else AT - 1
    assert said[0] == f"dpledger train: resuming job {job_id!r} after round {completed} ({out / 'checkpoint.pkl'})"
    if read:
        names_ = [_name(ledger, i) for i in ids]
        lost = [[c["charge_id"] for c in cs if c["round"] == AT - 1] for cs in at]
        assert said[1:] == [
            f"dpledger train: silo {i} ({n}): charge {c[0]} of round {AT} stays spent (it may have read data and was "
            "not checkpointed); that round is trained again under a new charge"
            for i, n, c in zip(ids, names_, lost, strict=True)
        ]
    else:
        assert said[1:] == []

    for silo_id in ids:
        final = charges(ledger, silo_id, job_id)
        assert all(c["status"] != "reserved" for c in final)
        committed = [c["round"] for c in final if c["status"] == "committed"]
        # Each round charged once; the round stopped after it may have read data once more (never more).
        assert sorted(committed) == sorted([*range(ROUNDS), *([AT - 1] if read else [])])
        released = [c["round"] for c in final if c["status"] == "released"]
        assert released == ([AT - 1] if point == "after-reserve" else [])
        body = httpx.get(f"{ledger}/v1/silos/{silo_id}", headers=ADMIN).json()
        # The ε of the rounds charged, by dp-accounting's curves through the silo's filter: ROUNDS rounds,
        # and one more only where the stopped round may have read data.
        charged = ROUNDS + (1 if read else 0)
        assert body["epsilon_spent"] == pytest.approx(
            dpsgd_epsilon(body, [(Q, SIGMA, STEPS * charged)], delta=DELTA, first=(Q, SIGMA, STEPS)), rel=1e-9)
        if not read:
            assert body["epsilon_spent"] == pytest.approx(reference["epsilon_spent"], rel=1e-12)
    # Every round trained once in the models' lineage: bitwise the uninterrupted run's models.
    resumed, expected_models = models(out), reference["models"]
    assert all(torch.equal(resumed["state"][k], v) for k, v in expected_models["state"].items())
    assert [torch.equal(resumed["deployed"][i], expected_models["deployed"][j])
            for i, j in zip(ids, expected_models["silo_ids"], strict=True)] == [True, True]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [r for r in range(1, ROUNDS + 1) for _ in range(2)]
    if stop is signal.SIGKILL:  # the hardest stop: the silos' receipts and the log still check out
        audited(ledger, tmp_path, monkeypatch, capsys)


def audited(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`dpledger verify --receipts` (the receipts both processes kept) and `dpledger audit`: no finding."""
    from dpledger.cli import main as cli

    monkeypatch.setenv("DPLEDGER_URL", url)
    monkeypatch.setenv("DPLEDGER_KEY", ADMIN_KEY)
    deadline = time.monotonic() + 30  # the sequencer signs a head per batch: the last receipts' entries soon
    while (code := cli(["verify", "--receipts"])) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 0, capsys.readouterr()
    # Per silo: round 1 reserved and committed, round 2 reserved, then killed; on resume, that charge
    # committed, round 2 reserved and committed again, round 3 reserved and committed: 8 receipts.
    assert capsys.readouterr().out.startswith("ok: 16 receipts")
    auditor = httpx.post(f"{url}/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]
    monkeypatch.setenv("DPLEDGER_KEY", auditor)
    assert cli(["audit", "--since", str(tmp_path / "head.json")]) == 0, capsys.readouterr()


def _name(url: str, silo_id: int) -> str:
    name: str = httpx.get(f"{url}/v1/silos/{silo_id}", headers=ADMIN).json()["name"]
    return name


def c(charge_id: int, status: str, round_index: int) -> Charge:
    return Charge(charge_id, ChargeStatus(status), round_index)


def test_the_settle_rule_on_resume_is_read_from_the_checkpoint_and_the_training_mark() -> None:
    held = [c(1, "committed", 0), c(2, "reserved", 1)]  # round 2 trained and checkpointed, its commit lost
    plan = reconcile([*held, c(3, "reserved", 2)], completed=1, training=1)
    assert ([x.charge_id for x in plan.commit], [x.charge_id for x in plan.release], plan.again) == ([2], [3], [])
    assert plan.charges == {0: 1, 1: 1, 2: 1} and plan.problems == []
    # Round 3 began training and was not checkpointed: spent (committed), trained again as its charge 2.
    plan = reconcile([*held, c(3, "reserved", 2), c(4, "released", 2)], completed=1, training=2)
    assert [x.charge_id for x in plan.commit] == [2, 3] and [x.charge_id for x in plan.again] == [3]
    assert plan.charges[2] == 2 and plan.release == []
    # A committed round the checkpoint does not hold would be trained and paid twice: refused.
    # Reserved past the checkpoint, its training never begun (no mark): provably untouched, released.
    plan = reconcile(held, completed=0, training=None)
    assert [x.charge_id for x in plan.release] == [2] and plan.commit == [] and plan.problems == []
    plan = reconcile([c(1, "committed", 0), c(2, "committed", 1)], completed=-1, training=1)
    assert plan.problems == ["round 1's charge 1 is committed but the checkpoint holds no round"]
    assert [x.charge_id for x in plan.again] == [2]
