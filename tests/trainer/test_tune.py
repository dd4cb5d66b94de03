"""`dpledger tune` end to end on small digits silos, on CPU, against a temporary ledger."""

from __future__ import annotations

import os

import pytest

from dpledger.tune import TuneConfig, run_tune
from dpledger.worker_cli import main

os.environ.setdefault("OMP_NUM_THREADS", "1")


def test_tune_runs_exactly_the_k_trials_the_ledger_drew_and_reports_the_best_lambda(capsys: pytest.CaptureFixture[str]) -> None:
    grid = (0.0, 1.0, 10.0)
    outcomes = run_tune(TuneConfig(grid=grid, silos=3, rounds=2, mean_trials=2.0, distribution="geometric", device="cpu"))

    assert len(outcomes) == 3
    for outcome in outcomes:
        assert outcome.trials is not None and outcome.trials >= 1  # geometric: K ≥ 1
        assert len(outcome.scores) == outcome.trials
        assert outcome.best_lambda in grid
        assert outcome.best_accuracy == max(score for _, score in outcome.scores)


def test_a_search_over_budget_is_refused_and_runs_no_trial() -> None:
    outcomes = run_tune(TuneConfig(grid=(1.0,), silos=2, rounds=1, epsilon=0.01, device="cpu"))
    assert all(o.trials is None and o.scores == [] for o in outcomes)


def test_the_tune_subcommand_prints_the_best_lambda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--grid", "0,10", "--silos", "2", "--rounds", "1", "--mean-trials", "1.5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "best λ" in out and "accuracy" in out
