"""The round loop against a real ledger over HTTP: refusals stop a silo's spending for good, the
run is reproducible from a seed, and the demo leaves its report. Expected ε are dp-accounting's
curves read through each silo's published filter (tests/gate_oracle.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import count
from typing import Any

import pytest
import torch

from dpledger.demo import DemoConfig, run_demo
from dpledger.harness import running_server
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import MRMTL, DPSGDConfig
from dpledger.trainer.loop import GatedSilo, RoundRecord, run_gated
from dpledger.wire.client import LedgerClient
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import budget_admitting, dpsgd_epsilon

CONFIG = DPSGDConfig(batch_size=16, local_steps=2, noise_multiplier=1.5, seed=3)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('loop')}/ledger.db"
    with running_server(database_url=url, admin_key=ADMIN_KEY) as base:
        yield base


def digits_mrmtl(silos: int, *, seed: int = 3) -> MRMTL:
    data = make_rotated_masked_digits(n_silos=silos, seed=seed)
    return MRMTL(
        lam=0.5, **data.tensors(), num_classes=10, config=CONFIG,
    )


def round_of(algorithm: MRMTL, k: int) -> dict[str, Any]:
    """Silo k's round of the job, as the workload its silo declares at registration (its horizon)."""
    return {"type": "dpsgd", "noise_multiplier": CONFIG.noise_multiplier, "batch_size": algorithm.batch_sizes[k],
            "steps": CONFIG.local_steps}


def register(url: str, algorithm: MRMTL, budgets: list[float], prefix: str, *, horizons: bool = False) -> list[GatedSilo]:
    with LedgerClient(url, ADMIN_KEY) as admin:
        created = [
            admin.create_silo(name=f"{prefix}-{k}", epsilon=b, delta=1e-5, dataset_size=algorithm.train.sizes[k],
                              horizon=round_of(algorithm, k) if horizons else None)
            for k, b in enumerate(budgets)
        ]
    return [GatedSilo(c.id, LedgerClient(url, c.api_key)) for c in created]


def rounds_run(rounds: int, *, q: float) -> list[tuple[float, float, int]]:
    return [(q, CONFIG.noise_multiplier, CONFIG.local_steps * rounds)]


def budget_for_rounds(url: str, algorithm: MRMTL, k: int, rounds: int, prefix: str) -> float:
    """The budget at which silo k, declaring its round as horizon, is admitted exactly `rounds` rounds:
    a fixed point of budget and filter (tests/gate_oracle.py), found on probe silos. Under the default
    horizon a job of a few steps per round reads nearly the same ε for its first rounds (its cheapest
    orders hold a 1/1550 share of δ), so budgets admitting exactly k of them are narrow or absent."""
    q, probes = algorithm.batch_sizes[k] / algorithm.train.sizes[k], count()
    with LedgerClient(url, ADMIN_KEY) as admin:

        def probe(budget: float) -> Any:
            made = admin.create_silo(name=f"{prefix}-probe-{next(probes)}", epsilon=budget, delta=1e-5,
                                     dataset_size=algorithm.train.sizes[k], horizon=round_of(algorithm, k))
            return admin.silo(made.id)

        return float(budget_admitting(probe, rounds_run(rounds, q=q), rounds_run(rounds + 1, q=q), delta=1e-5).epsilon)


def test_a_refused_silo_stops_spending_and_its_model_freezes(ledger: str) -> None:
    algorithm = digits_mrmtl(3)
    q = [b / n for b, n in zip(algorithm.batch_sizes, algorithm.train.sizes, strict=True)]
    k_rounds = 2
    budgets = [budget_for_rounds(ledger, algorithm, 0, k_rounds, "freeze"), 1000.0, 1000.0]  # silo 0 admits exactly 2 rounds
    silos = register(ledger, algorithm, budgets, "freeze", horizons=True)
    frozen_at: list[torch.Tensor] = []

    def watch(record: RoundRecord) -> None:
        if record.round_index == k_rounds - 1:
            frozen_at.append(algorithm.silo_state["personal"][0].clone())

    run = run_gated(algorithm, silos, rounds=5, job_id="freeze", on_round=watch)

    assert run.approved_rounds() == [k_rounds, 5, 5]
    assert run.refused_rounds() == [1, 0, 0]  # asked once more, refused, then never again
    assert run.stopped == [True, False, False]
    assert torch.equal(algorithm.silo_state["personal"][0], frozen_at[0])
    history = silos[0].client.history(silos[0].silo_id)
    assert [e.event for e in history].count("reserve") == k_rounds
    assert all(e.event != "release" for e in history)
    spent = silos[0].client.silo(silos[0].silo_id)
    assert spent.epsilon_committed == pytest.approx(dpsgd_epsilon(spent, rounds_run(k_rounds, q=q[0]), delta=1e-5), rel=1e-9)
    assert spent.epsilon_spent <= budgets[0]


def test_a_second_run_under_the_same_job_id_trains_nothing_on_the_replayed_reservations(ledger: str) -> None:
    algorithm = digits_mrmtl(2)
    silos = register(ledger, algorithm, [1000.0, 1000.0], "replay")
    first = run_gated(algorithm, silos, rounds=2, job_id="replay", on_round=None)
    assert first.approved_rounds() == [2, 2] and not first.failed
    again = digits_mrmtl(2)
    second = run_gated(again, silos, rounds=2, job_id="replay")
    assert second.failed and second.stopped == [True, True] and second.approved_rounds() == [0, 0]
    assert "was reserved before" in (second.stop_reason or "") and "use a new job id" in (second.stop_reason or "")
    assert all(torch.equal(t, again.state()[name]) for name, t in digits_mrmtl(2).state().items())  # untouched
    spent = silos[0].client.silo(silos[0].silo_id)
    assert [e.event for e in silos[0].client.history(silos[0].silo_id)].count("reserve") == 2  # charged once
    q = algorithm.batch_sizes[0] / algorithm.train.sizes[0]
    assert spent.epsilon_spent == pytest.approx(dpsgd_epsilon(spent, rounds_run(2, q=q), delta=1e-5), rel=1e-9)


def test_a_key_revoked_mid_run_releases_the_rounds_other_reservations_and_fails(ledger: str) -> None:
    algorithm = digits_mrmtl(2)
    silos = register(ledger, algorithm, [1000.0, 1000.0], "revoked")
    second_key = silos[1].client.who_am_i().key_id

    def revoke_after_round_0(record) -> None:  # type: ignore[no-untyped-def]
        if record.round_index == 0:
            with LedgerClient(ledger, ADMIN_KEY, receipts=False) as admin:
                admin.revoke_key(second_key)

    run = run_gated(algorithm, silos, rounds=3, job_id="revoked", on_round=revoke_after_round_0)
    assert run.failed and run.approved_rounds() == [1, 1]
    # Round index 1, counted from 1 where people read it.
    assert (run.stop_reason or "").startswith(f"the ledger rejected silo {silos[1].silo_id}'s reservation for round 2: 401")
    events = [(e.event, e.round) for e in silos[0].client.history(silos[0].silo_id) if e.round is not None]
    assert events == [("reserve", 0), ("commit", 0), ("reserve", 1), ("release", 1)]  # nothing left stranded


def test_the_same_seed_gives_the_same_run(ledger: str) -> None:
    records = []
    for attempt in range(2):
        algorithm = digits_mrmtl(4)
        silos = register(ledger, algorithm, [5.0] * 4, f"repro-{attempt}")
        run = run_gated(algorithm, silos, rounds=3, job_id=f"repro-{attempt}")
        records.append([(r.metric, r.update_norms, r.epsilon_spent) for r in run.rounds])
    assert records[0] == records[1]


def demo_filters(url: str, budgets: list[float], sizes: list[int], *, sigma: float, steps: int = 10) -> list[Any]:
    """The filters the demo's silos commit to: silos registered here as the demo registers its own
    (budget, δ, size, and one round of DP-SGD at batch 16 as the horizon), read back from the ledger."""
    with LedgerClient(url, ADMIN_KEY) as admin:
        made = [
            admin.create_silo(name=f"demo-probe-{sigma}-{k}", epsilon=b, delta=1e-5, dataset_size=n,
                              horizon={"type": "dpsgd", "noise_multiplier": sigma, "steps": steps, "batch_size": min(16, n)})
            for k, (b, n) in enumerate(zip(budgets, sizes, strict=True))
        ]
        return [admin.silo(m.id) for m in made]


def demo_rounds_epsilon(silo: Any, rounds: int, *, q: float, sigma: float, steps: int = 10, delta: float = 1e-5) -> float:
    return dpsgd_epsilon(silo, [(q, sigma, rounds * steps)], delta=delta)


def test_the_demo_stops_each_silo_at_its_own_budget_and_records_its_settings(ledger: str, tmp_path) -> None:
    """The default story: one σ for all, a ladder of budgets; each silo trains exactly as many rounds
    as dp-accounting, read through its filter, says its budget buys, and the report says so with σ,
    q, δ and the seed."""
    sigma, rounds = 0.7, 3
    table = run_demo(DemoConfig(silos=4, rounds=rounds, seed=1, out=tmp_path, noise_multiplier=sigma, progress=False))
    assert {p.name for p in tmp_path.iterdir()} == {"settings.json", "metrics.jsonl", "accuracy.png", "epsilon.png", "table.txt"}
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["epsilons"] == [3.0, 4.8, 7.6, 12.0] and settings["noise_multipliers"] == [sigma] * 4
    assert (settings["delta"], settings["seed"], settings["chance"], settings["calibrated"]) == (1e-5, 1, 0.1, False)
    sizes = settings["dataset_sizes"]
    assert settings["sampling_rates"] == [16 / n for n in sizes]

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * rounds * 4  # algorithms × rounds × silos
    bought = []
    filters = demo_filters(ledger, settings["epsilons"], sizes, sigma=sigma)
    for k, budget in enumerate(settings["epsilons"]):
        q = 16 / sizes[k]
        cost = [demo_rounds_epsilon(filters[k], r, q=q, sigma=sigma) for r in range(rounds + 1)]
        expected = max(r for r in range(rounds + 1) if cost[r] <= budget)
        bought.append(expected)
        for algorithm in ("local", "fedavg", "mrmtl"):
            mine = [m for m in lines if m["algorithm"] == algorithm and m["silo"] == k]
            assert [m["approved"] for m in mine] == [r < expected for r in range(rounds)], (algorithm, k)
            assert [m["refused"] for m in mine] == [r == expected for r in range(rounds)], (algorithm, k)
            if expected:
                assert mine[-1]["epsilon_spent"] == pytest.approx(cost[expected], rel=1e-9)
            assert mine[-1]["epsilon_spent"] <= budget
    assert bought == [0, 1, 3, 3]  # refused at once, refused after one round, never refused (twice)

    low, high = f"{16 / max(sizes):.3g}", f"{16 / min(sizes):.3g}"
    q_range = low if low == high else f"{low}–{high}"
    caption = f"4 silos, σ = {sigma}, q = B/n_k = {q_range} (10 steps/round), δ = 1e-05, budgets: ladder, seed 1"
    assert table.splitlines()[0] == caption
    assert table.splitlines()[1] == "chance accuracy: 0.100 (1/10)"
    header = table.splitlines()[3].split()
    assert header[:4] == ["silo", "budget", "ε", "σ"] and "mrmtl" in header and header.count("ε") == 4
    rows = {line.split()[0]: line.split() for line in table.splitlines()[5:9]}
    assert rows["0"][5] == "0*" and rows["1"][5] == "1*" and rows["2"][5] == "3"
    for png in ("accuracy.png", "epsilon.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000


def test_the_calibrated_demo_spends_each_budget_exactly(tmp_path) -> None:
    run_demo(DemoConfig(silos=2, rounds=2, seed=1, out=tmp_path, calibrate=True, progress=False))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in lines if m["algorithm"] == "mrmtl" and m["round"] == 2]
    assert len(last) == 2  # both silos reached their last round: none was refused before it
    for m in last:
        assert m["approved"] and m["epsilon_spent"] <= m["budget"] * (1 + 1e-9)
        assert m["epsilon_spent"] == pytest.approx(m["budget"], rel=1e-6)  # noise calibrated to spend it exactly


def test_train_runs_a_configured_job_with_keys_from_the_environment(ledger: str, tmp_path, monkeypatch) -> None:
    from dpledger.worker_cli import main

    with LedgerClient(ledger, ADMIN_KEY) as admin:
        sizes = [s.n_train for s in make_rotated_masked_digits(n_silos=2, seed=0, mask_probability=0.1).silos]
        created = [admin.create_silo(name=f"train-{k}", epsilon=50.0, delta=1e-5, dataset_size=n) for k, n in enumerate(sizes)]
    config = tmp_path / "job.toml"
    config.write_text(
        f'url = "{ledger}"\njob_id = "toml-job"\nalgorithm = "ditto"\nrounds = 2\n'
        "[data]\nsilos = 2\n[dpsgd]\nlocal_steps = 2\n"
        + "".join(f'[[silos]]\nid = {c.id}\nkey_env = "KEY_{k}"\n' for k, c in enumerate(created))
    )
    for k, c in enumerate(created):
        monkeypatch.setenv(f"KEY_{k}", c.api_key)
    assert main(["train", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    with LedgerClient(ledger, created[0].api_key) as silo:
        history = silo.history(created[0].id)
    reserves = [e for e in history if e.event == "reserve"]
    assert [(e.job_id, e.round, e.mechanism["steps"] if e.mechanism else None) for e in reserves] == [
        ("toml-job", 0, 2 + 5),
        ("toml-job", 1, 2 + 5),
    ]
