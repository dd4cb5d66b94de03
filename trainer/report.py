"""The demo's report folder: settings.json, metrics.jsonl, accuracy.png, epsilon.png, table.txt.

Every number drawn or printed is a silo's own: its accuracy on its own test split, and the ε the
ledger answered when it approved that silo's round (not a client-side estimate). The settings that
produced them (σ, q, δ, seed, …) are written beside them and into every figure's title.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: the demo runs in CI and on servers
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dpledger.trainer.loop import JobRun


@dataclass(frozen=True)
class DemoSettings:
    silos: int
    rounds: int
    seed: int
    budgets: str  # "ladder" or the mixture's name
    epsilons: list[float]
    delta: float
    noise_multipliers: list[float]
    calibrated: bool
    sampling_rates: list[float]  # q_k = B / n_k, what the ledger computes from the registered size
    dataset_sizes: list[int]
    batch_size: int
    local_steps: int
    lr: float
    clip_norm: float
    lam: float
    mask_probability: float
    n_classes: int
    device: str

    @property
    def chance(self) -> float:
        """The accuracy of guessing among the classes; the demo's test splits are near-balanced."""
        return 1.0 / self.n_classes if self.n_classes else float("nan")

    def caption(self) -> str:
        sigma = (
            f"σ = {self.noise_multipliers[0]:g}" if len(set(self.noise_multipliers)) == 1
            else f"σ_k calibrated, {min(self.noise_multipliers):.3g}–{max(self.noise_multipliers):.3g}"
        )
        low, high = f"{min(self.sampling_rates):.3g}", f"{max(self.sampling_rates):.3g}"
        q = f"q = B/n_k = {low}" if low == high else f"q = B/n_k = {low}–{high}"
        return (
            f"{self.silos} silos, {sigma}, {q} ({self.local_steps} steps/round), δ = {self.delta:g}, "
            f"budgets: {self.budgets}, seed {self.seed}"
        )


@dataclass(frozen=True)
class SiloOutcome:
    """One silo under one algorithm, at the end of the run."""

    rounds_trained: int
    refused_at: int | None  # the round the ledger refused, if it did (from 1, as every round shown)
    epsilon_spent: float
    accuracy: float


def outcomes(run: JobRun, silos: int) -> list[SiloOutcome]:
    approved = run.approved_rounds()
    result = []
    for k in range(silos):
        refusal = run.refusals.get(k)
        spent = max((r.epsilon_spent[k] for r in run.rounds), default=0.0)
        accuracy = run.rounds[-1].metric[k] if run.rounds else float("nan")
        result.append(SiloOutcome(approved[k], None if refusal is None else refusal.round_index + 1, spent, accuracy))
    return result


def write_report(out: Path, runs: Mapping[str, JobRun], settings: DemoSettings) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(settings) | {"chance": settings.chance}, indent=2) + "\n")
    write_metrics(out / "metrics.jsonl", runs, settings)
    plot_accuracy(out / "accuracy.png", runs, settings)
    plot_epsilon(out / "epsilon.png", runs, settings)
    table = format_table(runs, settings)
    (out / "table.txt").write_text(table + "\n")
    return table


def write_metrics(path: Path, runs: Mapping[str, JobRun], settings: DemoSettings) -> None:
    with path.open("w") as out:
        for algorithm, run in runs.items():
            for record in run.rounds:
                for k, budget in enumerate(settings.epsilons):
                    out.write(json.dumps({
                        "algorithm": algorithm, "round": record.round_index + 1, "silo": k, "budget": budget,
                        "noise_multiplier": settings.noise_multipliers[k], "sampling_rate": settings.sampling_rates[k],
                        "epsilon_spent": record.epsilon_spent[k], "approved": record.approved[k],
                        "refused": record.refused[k], "accuracy": _finite(record.metric[k]),
                        "update_norm": _finite(record.update_norms[k]),
                    }) + "\n")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _budget_colours(settings: DemoSettings):  # type: ignore[no-untyped-def]  # matplotlib is untyped here
    """A colour per silo from its budget, and the mappable for the colour bar."""
    low, high = min(settings.epsilons), max(settings.epsilons)
    norm = Normalize(vmin=low, vmax=high if high > low else low * 1.01)
    cmap = plt.get_cmap("viridis")
    mappable = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    return [cmap(norm(e)) for e in settings.epsilons], mappable


def _round_axis(axis: Axes, rounds: int) -> None:
    axis.set_xlabel("round")
    axis.set_xlim(0.5, rounds + 0.5)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=3))
    axis.grid(alpha=0.3)


def _finish(
    figure: Figure, axes: Any, mappable: ScalarMappable, path: Path, *, ylabel: str, legend: str, title: str
) -> None:
    """Labels the first panel of `axes` (a 1×n grid), adds the budget colour bar and the title, saves
    and closes."""
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(loc=legend, fontsize=8)
    figure.colorbar(mappable, ax=axes[0].tolist(), label="silo's budget ε", fraction=0.025, pad=0.01)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def plot_accuracy(path: Path, runs: Mapping[str, JobRun], settings: DemoSettings) -> None:
    """Per algorithm: every silo's own test accuracy per round (colour: its budget), ✕ where the
    ledger refused it, the mean over silos, and the chance level."""
    colours, mappable = _budget_colours(settings)
    figure, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.6), sharey=True, squeeze=False)
    for axis, (algorithm, run) in zip(axes[0], runs.items(), strict=True):
        rounds = [r.round_index + 1 for r in run.rounds]
        for k in range(settings.silos):
            accuracy = [r.metric[k] for r in run.rounds]
            axis.plot(rounds, accuracy, color=colours[k], linewidth=1.0, alpha=0.85)
            refusal = run.refusals.get(k)
            if refusal is not None and refusal.round_index < len(accuracy):
                axis.plot(refusal.round_index + 1, accuracy[refusal.round_index], marker="x", color=colours[k], markersize=7)
        mean = [sum(r.metric) / len(r.metric) for r in run.rounds]
        axis.plot(rounds, mean, color="black", linewidth=2.4, label="mean over silos")
        axis.axhline(settings.chance, color="tab:red", linestyle="--", linewidth=1.2, label=f"chance (1/{settings.n_classes})")
        axis.plot([], [], marker="x", linestyle="none", color="grey", label="refused by the ledger")
        axis.set_title(algorithm)
        axis.set_ylim(0.0, 1.0)
        _round_axis(axis, settings.rounds)
    _finish(figure, axes, mappable, path, ylabel="each silo's test accuracy (its own split)", legend="upper left",
            title=f"Accuracy per silo and round: {settings.caption()}")


def refusal_point(run: JobRun, k: int) -> tuple[int, float] | None:
    """Where silo k's refusal is drawn: its round, at the ε that round would have reached (the gate's
    reading in the 409), which lies above the budget. Drawn at the ε already spent, below the budget
    line, a refusal looked like a round under budget. None: never refused."""
    refusal = run.refusals.get(k)
    if refusal is None:
        return None
    if refusal.epsilon_if_approved is not None:
        return refusal.round_index + 1, refusal.epsilon_if_approved
    # Beyond the RDP orders (the API's null): at the budget, the least it would have crossed.
    return refusal.round_index + 1, refusal.budget


def _epsilon_trace(run: JobRun, silos: int) -> tuple[object, ...]:
    """What the ε panel of `run` draws, to tell runs whose panels would be the same picture."""
    spent = tuple((r.round_index, tuple(r.approved), tuple(r.epsilon_spent)) for r in run.rounds)
    return spent, tuple(refusal_point(run, k) for k in range(silos))


def epsilon_panels(runs: Mapping[str, JobRun], silos: int) -> list[tuple[str, JobRun]]:
    """One panel per distinct picture, titled by every algorithm it stands for: the algorithms of one
    demo share the noise and the budgets, so each silo spends the same ε under all of them, and three
    identical panels only made the reader look for a difference."""
    panels: dict[tuple[object, ...], tuple[list[str], JobRun]] = {}
    for algorithm, run in runs.items():
        panels.setdefault(_epsilon_trace(run, silos), ([], run))[0].append(algorithm)
    return [(", ".join(names) + (" (the same ε)" if len(names) > 1 else ""), run) for names, run in panels.values()]


def plot_epsilon(path: Path, runs: Mapping[str, JobRun], settings: DemoSettings) -> None:
    """Every silo's ε spent as the ledger answered it (solid) against its budget (dashed, same colour);
    a silo's line ends where the ledger refused its next round, drawn ✕ at the ε that round would have
    reached, above the budget. One panel for algorithms whose ε is the same (epsilon_panels)."""
    colours, mappable = _budget_colours(settings)
    panels = epsilon_panels(runs, settings.silos)
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.5, 4.6), sharey=True, squeeze=False)
    top = max(settings.epsilons)
    for axis, (title, run) in zip(axes[0], panels, strict=True):
        for k, budget in enumerate(settings.epsilons):
            trained = [(r.round_index + 1, r.epsilon_spent[k]) for r in run.rounds if r.approved[k]]
            if trained:
                axis.plot(*zip(*trained, strict=True), color=colours[k], marker=".", linewidth=1.2)
            axis.axhline(budget, color=colours[k], linestyle="--", linewidth=0.9, alpha=0.9)
            refused = refusal_point(run, k)
            if refused is not None:
                last = trained[-1] if trained else (refused[0] - 1, 0.0)
                axis.plot([last[0], refused[0]], [last[1], refused[1]], color=colours[k], linestyle=":", linewidth=1.0)
                axis.plot(*refused, marker="x", color=colours[k], markersize=8, markeredgewidth=2)
                top = max(top, refused[1])
        axis.plot([], [], color="grey", marker=".", label="ε spent (ledger)")
        axis.plot([], [], color="grey", linestyle="--", label="budget ε")
        axis.plot([], [], color="grey", marker="x", linestyle="none", label="refused: the ε that round would reach")
        axis.set_title(title)
        _round_axis(axis, settings.rounds)
    axes[0][0].set_ylim(0.0, top * 1.08)
    _finish(figure, axes, mappable, path, ylabel="ε spent at δ, per silo", legend="lower right",
            title=f"ε spent against each silo's own budget: {settings.caption()}")


def format_table(runs: Mapping[str, JobRun], settings: DemoSettings) -> str:
    """Per silo: its budget and q, then per algorithm the rounds it trained, its ε spent and its
    final accuracy; every ε column is labelled with its algorithm."""
    per = {a: outcomes(run, settings.silos) for a, run in runs.items()}
    head = f"{'silo':<6}{'budget ε':>9}{'σ':>7}{'q':>7}"
    for a in runs:
        head += f" | {a + ' rounds':>14}{a + ' ε':>11}{a + ' acc':>12}"
    lines = [settings.caption(), f"chance accuracy: {settings.chance:.3f} (1/{settings.n_classes})", "", head, "-" * len(head)]
    for k in range(settings.silos):
        line = f"{k:<6}{settings.epsilons[k]:>9.3g}{settings.noise_multipliers[k]:>7.3g}{settings.sampling_rates[k]:>7.3f}"
        for a in runs:
            o = per[a][k]
            stopped = "" if o.refused_at is None else "*"
            line += f" | {str(o.rounds_trained) + stopped:>14}{o.epsilon_spent:>11.3f}{o.accuracy:>12.3f}"
        lines.append(line)
    lines.append("-" * len(head))
    mean = f"{'mean':<29}"
    for a in runs:
        accuracies = [o.accuracy for o in per[a]]
        mean += f" | {'':>14}{'':>11}{sum(accuracies) / len(accuracies):>12.3f}"
    lines.append(mean)
    lines.append(f"* refused by the ledger: its next round would have exceeded the silo's budget (of {settings.rounds} rounds)")
    return "\n".join(lines)
