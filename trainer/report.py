"""The run's report folder: metrics.jsonl, PNG plots (matplotlib, headless), and the printed table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the demo runs in CI and on servers
import matplotlib.pyplot as plt

from dpledger.trainer.loop import JobRun


@dataclass(frozen=True)
class SiloRow:
    name: str
    budget: float
    epsilon_spent: float
    approved: int
    refused: int
    final: dict[str, float]  # algorithm → final accuracy


def write_metrics(path: Path, runs: dict[str, JobRun], *, budgets: Sequence[float]) -> None:
    with path.open("w") as out:
        for algorithm, run in runs.items():
            for record in run.rounds:
                for k, budget in enumerate(budgets):
                    out.write(json.dumps({
                        "algorithm": algorithm, "round": record.round_index, "silo": k, "budget": budget,
                        "epsilon_spent": record.epsilon_spent[k], "approved": record.approved[k],
                        "refused": record.refused[k], "accuracy": _finite(record.metric[k]),
                        "update_norm": _finite(record.update_norms[k]),
                    }) + "\n")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def plot_accuracy(path: Path, runs: dict[str, JobRun]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for algorithm, run in runs.items():
        rounds = [r.round_index + 1 for r in run.rounds]
        mean = [sum(r.metric) / len(r.metric) for r in run.rounds]
        axis.plot(rounds, mean, marker="o", markersize=3, label=algorithm)
    axis.set_xlabel("round")
    axis.set_ylabel("mean test accuracy over silos")
    axis.set_title("Accuracy per round (every round approved by the ledger)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_epsilon(path: Path, run: JobRun, *, budgets: Sequence[float], algorithm: str) -> None:
    figure, axis = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rounds = [r.round_index + 1 for r in run.rounds]
    for k, budget in enumerate(budgets):
        color = colors[k % len(colors)]
        axis.plot(rounds, [r.epsilon_spent[k] for r in run.rounds], color=color, marker=".", label=f"silo {k}")
        axis.axhline(budget, color=color, linestyle="--", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_xlabel("round")
    axis.set_ylabel("ε spent (solid) and budget (dashed)")
    axis.set_title(f"{algorithm}: ε spent per round against each silo's budget")
    axis.grid(alpha=0.3, which="both")
    if len(budgets) <= 12:
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def format_table(rows: Sequence[SiloRow], algorithms: Sequence[str]) -> str:
    header = f"{'silo':<14}{'budget ε':>10}{'ε spent':>10}{'approved':>10}{'refused':>9}" + "".join(
        f"{'acc ' + a:>13}" for a in algorithms
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.name:<14}{row.budget:>10.4g}{row.epsilon_spent:>10.4g}{row.approved:>10}{row.refused:>9}"
            + "".join(f"{row.final[a]:>13.3f}" for a in algorithms)
        )
    means = {a: sum(r.final[a] for r in rows) / len(rows) for a in algorithms}
    lines.append("-" * len(header))
    lines.append(f"{'mean':<53}" + "".join(f"{means[a]:>13.3f}" for a in algorithms))
    return "\n".join(lines)
