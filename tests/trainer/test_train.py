"""`dpledger train` as a new user meets it: the whole job file checked before torch loads, every
silo's key and the ledger's view checked before round 0, a plan whose numbers are the ledger's, and
a run that writes its models and metrics and says truthfully how it ended (exit code included)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.harness import free_port, running_server
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.preflight import EPSILON_LEGEND
from dpledger.worker_cli import main
from tests.conftest import ADMIN, ADMIN_KEY
from tests.gate_oracle import budget_admitting, dpsgd_epsilon

SIZES = [s.n_train for s in make_rotated_masked_digits(n_silos=2, seed=0, mask_probability=0.1).silos]  # [674, 674]
SIGMA, BATCH, STEPS, DELTA = 1.5, 16, 2, 1e-5


@dataclass(frozen=True)
class Silo:
    id: int
    key: str


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(database_url=f"sqlite:///{tmp_path_factory.mktemp('train')}/l.db", admin_key=ADMIN_KEY) as url:
        yield url


# One round of the job files below, as a silo declares the workload it expects (its filter's order).
ROUND = {"type": "dpsgd", "noise_multiplier": SIGMA, "batch_size": BATCH, "steps": STEPS}


def create(url: str, name: str, epsilon: float, size: int = SIZES[0], *, horizon: dict[str, Any] | None = None) -> Silo:
    body: dict[str, Any] = {"name": name, "epsilon": epsilon, "delta": DELTA, "dataset_size": size}
    if horizon is not None:
        body["horizon"] = horizon
    created = httpx.post(f"{url}/v1/silos", json=body, headers=ADMIN).json()
    return Silo(created["id"], created["api_key"])


def job_file(path: Path, url: str, silo_ids: list[int], *, job_id: str, rounds: int = 3, extra: str = "") -> Path:
    path.write_text(
        f'url = "{url}"\njob_id = "{job_id}"\nalgorithm = "local"\nrounds = {rounds}\n{extra}'
        f"[data]\nsilos = {len(silo_ids)}\n[dpsgd]\nnoise_multiplier = {SIGMA}\nbatch_size = {BATCH}\nlocal_steps = {STEPS}\n"
        + "".join(f'[[silos]]\nid = {i}\nkey_env = "KEY_{k}"\n' for k, i in enumerate(silo_ids))
    )
    return path


def rounds_run(rounds: int, *, n: int = SIZES[0], sigma: float = SIGMA) -> list[tuple[float, float, int]]:
    return [(BATCH / n, sigma, rounds * STEPS)]


def rounds_epsilon(silo: dict[str, Any], rounds: int, *, sigma: float = SIGMA) -> float:
    """ε of `rounds` rounds of this job on `silo` (its GET body): dp-accounting's curves read through
    the silo's published filter (tests/gate_oracle.py); the service is not asked. A silo registered
    without a horizon and not charged yet publishes none: its first round will fix it."""
    first = rounds_run(1, sigma=sigma)[0]
    return dpsgd_epsilon(silo, rounds_run(rounds, sigma=sigma), delta=DELTA, first=first)


def detail(url: str, silo: Silo) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/v1/silos/{silo.id}", headers=ADMIN).json()
    return body


def admitting(url: str, name: str, rounds: int) -> tuple[Silo, dict[str, Any]]:
    """A silo that declares this job's round as its horizon and whose gate admits exactly `rounds`
    rounds of it. Its filter follows from its budget, so the budget is a fixed point
    (tests/gate_oracle.py), found on probe silos (names are unique); the silo itself then gets the
    same filter from the same budget, δ, size and horizon.

    Under the default horizon (DP-SGD at q = 0.01, σ = 1) a budget of 1 reads this job's rounds 1–5
    at 0.958–0.995 (its cheapest orders hold a 1/1550 share of δ): on a 0.001 grid of budgets in
    [0.3, 1.5] none admits exactly 2 rounds, and those admitting exactly 4 are narrow bands near
    0.93 that the fixed-point search misses. A silo that expects this job declares it."""
    probes = iter(range(1000))

    def probe(budget: float) -> dict[str, Any]:
        return detail(url, create(url, f"{name}-probe-{next(probes)}", budget, horizon=ROUND))

    found = budget_admitting(probe, rounds_run(rounds), rounds_run(rounds + 1), delta=DELTA)
    silo = create(url, name, found["epsilon"], horizon=ROUND)
    body = detail(url, silo)
    assert body["filter"] == found["filter"]
    return silo, body


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """In a fresh interpreter that reports whether torch was imported."""
    code = "import sys; from dpledger.cli import main; rc = main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(rc)"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


def test_every_mistake_in_the_job_file_is_one_line_before_torch_loads(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'url = "http://127.0.0.1:9"\nalgorithm = "fedvag"\nround = 3\n'
        '[data]\nsource = "npz"\npath = "' + str(tmp_path / "nowhere") + '"\n[dpsgd]\nnoise_multplier = 1.1\n'
    )
    done = run_cli(["train", str(bad)], env={"PATH": "/usr/bin"})
    assert done.returncode == 2 and done.stdout == "False\n"  # torch was never imported
    assert sorted(done.stderr.splitlines()) == sorted([
        f"dpledger train: {bad}: algorithm: must be one of ditto, fedavg, finetune, ifca, ifca_mrmtl, local, mrmtl, pmtl, ppsgd;"
        " found 'fedvag' (did you mean fedavg?)",
        f"dpledger train: {bad}: round: unknown key (did you mean rounds?)",
        f"dpledger train: {bad}: dpsgd.noise_multplier: unknown key (did you mean dpsgd.noise_multiplier?)",
        f"dpledger train: {bad}: silos: missing: add one [[silos]] table (id, key_env) per data silo, in the data's order",
        f"dpledger train: {bad}: data.path: {tmp_path / 'nowhere'} is not a folder (expected one .npz file per silo)",
    ])

    keys = job_file(tmp_path / "keys.toml", "http://127.0.0.1:9", [1, 1, 2], job_id="j", extra="")
    keys.write_text(keys.read_text().replace("silos = 3", "silos = 2"))
    done = run_cli(["train", str(keys)], env={"PATH": "/usr/bin", "KEY_0": "dpl_x"})
    assert done.returncode == 2 and done.stdout == "False\n"
    assert done.stderr.splitlines() == [
        f"dpledger train: {keys}: silos: id 1 is listed 2 times",
        f"dpledger train: {keys}: silos[1] (id 1): the environment variable KEY_1 is not set",
        f"dpledger train: {keys}: silos[2] (id 2): the environment variable KEY_2 is not set",
        f"dpledger train: {keys}: silos: 3 [[silos]] tables for 2 data silos: give one per data silo, in order",
    ]

    broken = tmp_path / "broken.toml"
    broken.write_text('url = "http://x\n')
    done = run_cli(["train", str(broken)], env={"PATH": "/usr/bin"})
    assert done.returncode == 2 and done.stdout == "False\n"
    assert done.stderr == f"dpledger train: {broken}: not valid TOML: Illegal character '\\n' (at line 1, column 16)\n"
    done = run_cli(["train", str(tmp_path / "absent.toml")], env={"PATH": "/usr/bin"})
    assert (done.returncode, done.stderr) == (2, f"dpledger train: {tmp_path / 'absent.toml'}: no such file\n")


def test_keys_and_silo_ids_are_checked_before_round_0(ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    a, b = create(ledger, "keys-a", 50.0), create(ledger, "keys-b", 50.0)
    job = job_file(tmp_path / "job.toml", ledger, [a.id, 999], job_id="keys")
    monkeypatch.setenv("KEY_0", a.key)
    monkeypatch.setenv("KEY_1", a.key)
    assert main(["train", str(job), "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dpledger train: silos[1] (id 999): $KEY_1 holds silo {a.id}'s key, not silo 999's: fix the id or the variable"
    ]
    job_file(job, ledger, [a.id, b.id], job_id="keys")
    monkeypatch.setenv("KEY_1", "dpl_not-a-key")
    assert main(["train", str(job), "--no-progress"]) == 2
    unknown = f"dpledger train: silos[1] (id {b.id}): the key in $KEY_1 is unknown to this ledger or revoked\n"
    assert capsys.readouterr().err == unknown
    monkeypatch.setenv("KEY_1", ADMIN_KEY)
    assert main(["train", str(job), "--no-progress"]) == 2
    admin = f"dpledger train: silos[1] (id {b.id}): $KEY_1 holds an admin key; each silo trains with its own silo key\n"
    assert capsys.readouterr().err == admin
    # Nothing was charged by any of this.
    for silo in (a, b):
        assert httpx.get(f"{ledger}/v1/silos/{silo.id}", headers=ADMIN).json()["epsilon_spent"] == 0.0

    monkeypatch.setenv("KEY_1", b.key)
    down = job_file(tmp_path / "down.toml", f"http://127.0.0.1:{free_port()}", [a.id, b.id], job_id="keys")
    assert main(["train", str(down), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("dpledger train: cannot reach the ledger at http://127.0.0.1:") and err.count("\n") == 1


def test_a_data_set_smaller_than_the_registered_size_is_refused(ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    a, b = create(ledger, "size-a", 50.0), create(ledger, "size-b", 50.0, size=SIZES[1] + 100)
    monkeypatch.setenv("KEY_0", a.key)
    monkeypatch.setenv("KEY_1", b.key)
    assert main(["train", str(job_file(tmp_path / "j.toml", ledger, [a.id, b.id], job_id="size")), "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"dpledger train: silo {b.id} (size-b): the data has {SIZES[1]} training records but the ledger charges as if it had "
        f"{SIZES[1] + 100} (dataset_size): q would be under-charged; register the silo with dataset_size = {SIZES[1]}"
    )


def test_plan_prints_the_ledgers_cost_per_round_and_the_rounds_each_budget_buys(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made = [admitting(ledger, "plan-0", 4), admitting(ledger, "plan-1", 0)]  # buys 4 rounds; buys none
    silos, bodies = [s for s, _ in made], [b for _, b in made]
    for k, s in enumerate(silos):
        monkeypatch.setenv(f"KEY_{k}", s.key)
    job = job_file(tmp_path / "plan.toml", ledger, [s.id for s in silos], job_id="plan", rounds=10)
    assert main(["train", str(job), "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {int(line.split()[0]): re.split(r"\s{2,}", line) for line in lines[2:4]}
    # Each ε is the gate's reading (what the ledger will state and charge), with dp-accounting's
    # non-adaptive ε of the same charges in brackets; both computed here from dp-accounting's curves.
    def reference(rounds: int) -> float:
        accountant = rdp_lib.RdpAccountant()
        accountant.compose(de.PoissonSampledDpEvent(BATCH / SIZES[0], de.GaussianDpEvent(SIGMA)), rounds * STEPS)
        return float(accountant.get_epsilon(DELTA))

    def cell(body: dict[str, Any], rounds: int) -> str:
        return f"{rounds_epsilon(body, rounds):.4g} ({reference(rounds):.4g})"

    for silo, body, bought in zip(silos, bodies, ["4", "0"], strict=True):
        assert rows[silo.id] == [str(silo.id), body["name"], f"{body['epsilon']:.4g}", "0 (0)", cell(body, 1), cell(body, 10),
                                 bought]
    assert lines[4] == EPSILON_LEGEND
    advice = "raise dpsgd.noise_multiplier or lower rounds to train them all"
    assert lines[5:] == [
        f"silo {silos[0].id} (plan-0): its budget stops it after 4 of 10 rounds; {advice}",
        f"silo {silos[1].id} (plan-1): its budget stops it after 0 of 10 rounds; {advice}",
    ]
    for silo in silos:  # a plan spends nothing
        assert httpx.get(f"{ledger}/v1/silos/{silo.id}", headers=ADMIN).json()["epsilon_spent"] == 0.0


def test_plan_calibrate_gives_the_sigma_at_which_each_remaining_budget_buys_every_round(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    budgets = [2.0, 5.0]
    silos = [create(ledger, f"cal-{k}", e) for k, e in enumerate(budgets)]
    for k, s in enumerate(silos):
        monkeypatch.setenv(f"KEY_{k}", s.key)
    job = job_file(tmp_path / "cal.toml", ledger, [s.id for s in silos], job_id="cal", rounds=6)
    assert main(["train", str(job), "--plan", "--calibrate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sigmas = [float(lines[2 + k].split()[-1]) for k in range(2)]

    for silo, sigma, budget in zip(silos, sigmas, budgets, strict=True):
        body = detail(ledger, silo)
        # Enough, and not much more than enough, as the silo's gate reads it.
        assert rounds_epsilon(body, 6, sigma=sigma) <= budget < rounds_epsilon(body, 6, sigma=sigma * 0.99)
    assert sigmas[0] > sigmas[1]
    assert lines[-1].startswith(f"every silo trains all 6 rounds at dpsgd.noise_multiplier = {lines[2].split()[-1]} ")


def test_train_writes_models_and_metrics_and_stops_each_silo_at_its_budget(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first, body = admitting(ledger, "run-0", 2)  # refused its third round
    silos = [first, create(ledger, "run-1", 100.0)]
    for k, s in enumerate(silos):
        monkeypatch.setenv(f"KEY_{k}", s.key)
    job = job_file(tmp_path / "run.toml", ledger, [s.id for s in silos], job_id="run", rounds=4)
    out = tmp_path / "out"
    assert main(["train", str(job), "--out", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "budget is spent" not in captured.err
    after = [httpx.get(f"{ledger}/v1/silos/{s.id}", headers=ADMIN).json() for s in silos]
    assert after[0]["epsilon_spent"] == pytest.approx(rounds_epsilon(body, 2), rel=1e-9)
    assert after[1]["epsilon_spent"] == pytest.approx(rounds_epsilon(after[1], 4), rel=1e-9)
    would = f"{rounds_epsilon(body, 3):.4g}"
    refused = f"dpledger train: silo {silos[0].id} (run-0): refused at round 3: it would have reached ε = {would}"
    assert refused in captured.err

    saved = torch.load(out / "models.pt")
    assert saved["silo_ids"] == [s.id for s in silos] and set(saved["deployed"]) == {s.id for s in silos}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["round"], m["silo_id"], m["approved"]) for m in metrics if m["silo_id"] == silos[0].id] == [
        (1, silos[0].id, True), (2, silos[0].id, True), (3, silos[0].id, False), (4, silos[0].id, False)
    ]
    summary = json.loads((out / "summary.json").read_text())
    first = summary["silos"][0]
    assert (first["rounds_approved"], first["rounds_refused"], first["refused_at_round"]) == (2, 1, 3)
    assert first["epsilon_spent_after"] == after[0]["epsilon_spent"]
    # The printed table labels silos by ledger id and name.
    table = captured.out.splitlines()
    assert table[1].split()[:2] == [str(silos[0].id), "run-0"] and table[1].split()[5:7] == ["2", "1"]
    # ε spent as the ledger charges it (the gate's reading), dp-accounting's in brackets, with the legend.
    assert table[1].split()[3:5] == [f"{after[0]['epsilon_spent']:.4g}", f"({after[0]['epsilon_dp_accounting']:.4g})"]
    assert table[3] == EPSILON_LEGEND
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.PoissonSampledDpEvent(BATCH / SIZES[0], de.GaussianDpEvent(SIGMA)), 3 * STEPS)
    assert (f"{refused} (the gate's reading; dp-accounting's non-adaptive ε of the same charges, for reference: "
            f"{accountant.get_epsilon(DELTA):.4g}) > budget") in captured.err

    # A second run under the same job id would replay the old reservations and train unpaid: refused.
    assert main(["train", str(job), "--out", str(out), "--no-progress"]) == 2
    assert "already has charges of job_id 'run' (rounds 1–4)" in capsys.readouterr().err


def test_train_that_trains_nothing_says_so_and_exits_1(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    silos = [admitting(ledger, f"none-{k}", 0)[0] for k in range(2)]
    for k, s in enumerate(silos):
        monkeypatch.setenv(f"KEY_{k}", s.key)
    job = job_file(tmp_path / "none.toml", ledger, [s.id for s in silos], job_id="none", rounds=2)
    assert main(["train", str(job), "--out", str(tmp_path / "o"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "dpledger train: nothing trained: the ledger refused every silo's first round (see `dpledger train --plan`)"
    )
    assert "spent" not in err.splitlines()[-1]


def test_the_job_files_algorithms_are_the_registrys() -> None:
    from dpledger.trainer.federated import registry
    from dpledger.trainer.job_config import ALGORITHMS

    assert ALGORITHMS == tuple(registry.standalone())


def test_a_ledger_that_dies_mid_run_is_exit_3_with_what_ran_written_out_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpledger import worker_cli as cli
    from dpledger.harness import ServerProcess
    from dpledger.trainer import job as job_module
    from dpledger.wire.client import RETRY_WINDOW_ENV

    monkeypatch.setenv(RETRY_WINDOW_ENV, "3")  # the default 60 s rides out a restart; this ledger stays dead
    with ServerProcess(database_url=f"sqlite:///{tmp_path}/dies.db", admin_key=ADMIN_KEY) as server:
        silos = [create(server.url, f"dies-{k}", 100.0) for k in range(2)]
        for k, s in enumerate(silos):
            monkeypatch.setenv(f"KEY_{k}", s.key)
        real_run_job = job_module.run_job

        def run_then_die(*args, on_round=None, **kwargs):  # type: ignore[no-untyped-def]
            def kill_after_round_1(record):  # type: ignore[no-untyped-def]
                on_round(record)
                if record.round_index == 1:
                    server.kill()
            return real_run_job(*args, on_round=kill_after_round_1, **kwargs)

        monkeypatch.setattr(job_module, "run_job", run_then_die)
        job = job_file(tmp_path / "dies.toml", server.url, [s.id for s in silos], job_id="dies", rounds=5)
        assert cli.main(["train", str(job), "--out", str(tmp_path / "out"), "--no-progress"]) == 3
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("dpledger train: stopped: ledger unreachable before round 3:")
        metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert sorted({m["round"] for m in metrics}) == [1, 2]  # what ran is written out
        assert (tmp_path / "out" / "models.pt").exists()

        # The ledger back (same port and database), the job resumes where it stopped: rounds 3–5 only.
        server.start()
        monkeypatch.setattr(job_module, "run_job", real_run_job)
        assert cli.main(["train", str(job), "--out", str(tmp_path / "out"), "--no-progress", "--resume"]) == 0
        assert capsys.readouterr().err.splitlines()[1] == (
            f"dpledger train: resuming job 'dies' after round 2 ({tmp_path / 'out' / 'checkpoint.pkl'})")
        metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [m["round"] for m in metrics] == [r for r in range(1, 6) for _ in silos]
        for silo in silos:
            listed = httpx.get(f"{server.url}/v1/silos/{silo.id}/charges", headers=ADMIN).json()
            assert sorted((c["round"], c["status"]) for c in listed) == [(r, "committed") for r in range(5)]
