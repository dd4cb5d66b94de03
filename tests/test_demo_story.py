"""The demo's story lines say what its own numbers show, over its seeds.

The claims are recomputed here from the runs themselves with numpy (means over silos per seed,
sample standard deviation over seeds, FedAvg's gain on local per silo, Spearman's ρ as the Pearson
correlation of ranks), and the line the demo prints must state the verdict those numbers imply:
MR-MTL beats an algorithm only if its mean exceeds it in every seed; federating helps small budgets
only if the gain falls with the budget and changes sign between the ends. Runs built by hand check
that each verdict flips when the numbers do; one reduced demo (4 silos, 3 rounds, 3 seeds, a real
ledger) checks the printed report."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dpledger.demo import DemoConfig, budget_ladder, report, run_seeds
from dpledger.demo_story import story
from dpledger.trainer.loop import JobRun, RoundRecord
from dpledger.trainer.report import DemoSettings

ALGORITHMS = ("local", "fedavg", "mrmtl")


def settings(epsilons: list[float], *, rounds: int = 2, lam: float = 0.01) -> DemoSettings:
    k = len(epsilons)
    return DemoSettings(
        silos=k, rounds=rounds, seed=0, budgets="ladder", epsilons=epsilons, delta=1e-5, noise_multipliers=[1.2] * k,
        calibrated=False, sampling_rates=[0.1] * k, dataset_sizes=[160] * k, batch_size=16, local_steps=10, lr=0.5,
        clip_norm=1.0, lam=lam, mask_probability=0.1, n_classes=10, device="cpu",
    )


def job(accuracies: list[float], *, stopped: list[bool] | None = None) -> JobRun:
    """A two-round run whose last round scored `accuracies` (one per silo)."""
    k = len(accuracies)
    record = RoundRecord(round_index=1, approved=[True] * k, refused=[False] * k, epsilon_spent=[1.0] * k,
                         metric=list(accuracies), update_norms=[1.0] * k)
    first = RoundRecord(round_index=0, approved=[True] * k, refused=[False] * k, epsilon_spent=[0.5] * k,
                        metric=[0.1] * k, update_norms=[1.0] * k)
    return JobRun(job_id="x", rounds=[first, record], stopped=stopped or [False] * k)


def ranks(values: np.ndarray) -> np.ndarray:
    assert len(set(values.tolist())) == len(values), "no ties, so that plain ranks are Spearman's"
    return np.argsort(np.argsort(values)).astype(float)


def expected(runs: dict[int, dict[str, JobRun]], epsilons: list[float]) -> dict[str, object]:
    """Every number and verdict of the story, from the runs alone."""
    final = {a: np.array([runs[s][a].rounds[-1].metric for s in sorted(runs)]) for a in ALGORITHMS}  # [seeds, silos]
    means = {a: final[a].mean(axis=1) for a in ALGORITHMS}
    gains = (final["fedavg"] - final["local"]).mean(axis=0)
    budgets = np.array(epsilons)
    rho = float(np.corrcoef(ranks(budgets), ranks(gains))[0, 1])
    low, high = gains[budgets == budgets.min()].mean(), gains[budgets == budgets.max()].mean()
    return {
        "mean": {a: means[a].mean() for a in ALGORITHMS},
        "std": {a: means[a].std(ddof=1) for a in ALGORITHMS},
        "beats": {a: bool(np.all(means["mrmtl"] > means[a])) for a in ("local", "fedavg")},
        "rho": rho, "low": low, "high": high,
    }


def check_story(lines: list[str], runs: dict[int, dict[str, JobRun]], shown: DemoSettings) -> None:
    want = expected(runs, shown.epsilons)
    assert lines[0].startswith(f"over seeds {', '.join(map(str, sorted(runs)))}: ")
    for algorithm, label in (("local", "local"), ("fedavg", "FedAvg"), ("mrmtl", f"MR-MTL (λ = {shown.lam:g})")):
        mean, std = want["mean"][algorithm], want["std"][algorithm]
        assert f"{label} {mean:.3f} ± {std:.3f}" in lines[1]

    privacy = lines[2]
    assert f"{want['low']:+.3f} at the smallest budget" in privacy and f"{want['high']:+.3f} at the largest" in privacy
    assert f"ρ(budget, gain) = {want['rho']:+.2f}" in privacy
    helps = want["rho"] < 0 and want["low"] > 0 > want["high"]
    assert ("federating helps the silos with the least budget" in privacy) == helps
    assert ("does not show here" in privacy) == (want["rho"] >= 0)

    personalization = lines[3]
    beats = want["beats"]
    if all(beats.values()):
        assert "beats local and FedAvg in every seed" in personalization
    else:
        behind = [a for a, won in beats.items() if not won]
        assert "does not beat" in personalization
        assert ("does not beat local" in personalization) == ("local" in behind)
        assert ("FedAvg (" in personalization) == ("fedavg" in behind)
        assert ("rotation groups" in personalization) == ("local" in behind)


def hand_made(local: list[list[float]], fedavg: list[list[float]], mrmtl: list[list[float]]) -> dict[int, dict[str, JobRun]]:
    return {seed: {"local": job(local[seed]), "fedavg": job(fedavg[seed]), "mrmtl": job(mrmtl[seed])}
            for seed in range(len(local))}


def test_the_story_says_mrmtl_wins_only_when_it_wins_in_every_seed() -> None:
    shown = settings([3.0, 6.0, 12.0])
    local = [[0.2, 0.5, 0.8], [0.3, 0.5, 0.7]]
    fedavg = [[0.5, 0.5, 0.5], [0.6, 0.4, 0.4]]
    winning = [[0.5, 0.6, 0.8], [0.6, 0.55, 0.75]]  # above both in both seeds
    runs = hand_made(local, fedavg, winning)
    lines = story(runs, shown)
    check_story(lines, runs, shown)
    assert "beats local and FedAvg in every seed" in lines[3]
    assert "federating helps the silos with the least budget" in lines[2]  # gains +0.3, -0.05, -0.3

    # One seed where MR-MTL trails local: the claim is withdrawn and the reason given.
    trailing = [winning[0], [0.3, 0.45, 0.7]]
    runs = hand_made(local, fedavg, trailing)
    lines = story(runs, shown)
    check_story(lines, runs, shown)
    assert "does not beat local" in lines[3] and "rotation groups" in lines[3]


def test_the_story_says_when_privacy_does_not_favour_federating() -> None:
    shown = settings([3.0, 6.0, 12.0])
    local = [[0.8, 0.5, 0.2], [0.7, 0.5, 0.3]]  # local better where the budget is smallest: the opposite trend
    fedavg = [[0.5, 0.5, 0.5], [0.4, 0.45, 0.6]]
    runs = hand_made(local, fedavg, local)
    lines = story(runs, shown)
    check_story(lines, runs, shown)
    assert "does not show here" in lines[2]
    assert "does not beat local (" in lines[3] and "FedAvg (" in lines[3]

    # The gain falls with the budget but FedAvg wins at every budget: a trend, not the trade-off's sign change.
    fedavg = [[0.9, 0.7, 0.5], [0.8, 0.7, 0.6]]
    local = [[0.2, 0.4, 0.45], [0.3, 0.45, 0.5]]
    runs = hand_made(local, fedavg, local)
    lines = story(runs, shown)
    check_story(lines, runs, shown)
    assert "but FedAvg wins at both ends here" in lines[2]


def test_the_reduced_demo_prints_the_spread_over_three_seeds_and_what_it_shows(tmp_path: Path) -> None:
    config = DemoConfig(silos=4, rounds=3, seed=1, seeds=3, out=tmp_path, progress=False)
    demo = run_seeds(config)
    assert sorted(demo.runs) == [1, 2, 3]
    text = report(config, demo)
    shown = demo.settings[1]
    assert shown.epsilons == budget_ladder(4) and shown.lam == config.lam
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("over seeds "))
    check_story(lines[start:start + 4], demo.runs, shown)
    assert (tmp_path / "table.txt").read_text() == text + "\n"
    # The seeds differ (data, masks, noise): a spread of exactly zero would mean one seed run three times.
    assert all(float(std) > 0 for std in re.findall(r"± (\d\.\d+)", lines[start + 1]))
    # The seeds' silos are the ledger's own: same budgets, each seed charged on fresh silos.
    for seed in (2, 3):
        for algorithm in ALGORITHMS:
            first, later = demo.runs[1][algorithm], demo.runs[seed][algorithm]
            assert later.approved_rounds() == first.approved_rounds()  # the same budgets buy the same rounds


def test_a_demo_needs_a_seed() -> None:
    with pytest.raises(ValueError, match="seeds must be at least 1"):
        run_seeds(DemoConfig(seeds=0, progress=False))
