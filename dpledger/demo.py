"""`dpledger demo`: the whole product on one machine.

Starts the ledger on a temporary SQLite file on a free port of 127.0.0.1 and registers K digits
silos, each with its own (ε, δ). By default every silo trains with the same DP-SGD noise σ and the
budgets form a ladder (ε from 3 to 12): each round costs every silo about the same ε, so the ledger
approves rounds until a silo's next one would cross its own budget, then refuses it, silo by silo,
while the others go on. Local training, FedAvg and MR-MTL run this way, each as a separate job on
its own ledger with the same budgets (three alternative uses of the same promise). `--budgets
MixGauss1|2|3` draws the budgets from the Gaussian mixtures of "Differentially Private Federated
Learning with Heterogeneous Privacy Budgets" (Table 1) instead, and `--calibrate` asks the service
for each silo's σ so that all R rounds spend exactly its budget (nobody is refused; small budgets
then mean so much noise that nothing is learnt, which the report shows against the chance level).

Each silo declares its round (DP-SGD at its q and σ, `local_steps` steps) as its horizon when it is
registered, so the ledger fixes its filter's order where this workload spends the budget (the gate
is a Rényi filter at orders fixed before the first charge, Feldman & Zrnic 2021); under the default
horizon a digits silo here reads 7.6 after one round where the round costs 4.75 by dp-accounting.

The demo runs `seeds` seeds (3 by default: the data split, masks, initialisation and noise all
change with the seed), each on fresh silos of the same ledger, and prints each algorithm's mean
accuracy over silos as mean ± standard deviation over the seeds, then what that says about the
story of "On Privacy and Personalization in Cross-Silo Federated Learning" (`demo_story`): whether
stronger privacy favours federating (§4, Fig. 2), and whether MR-MTL beats both ends of the
personalization spectrum (§5), or why not on this data. The per-silo table and the figures show the
first seed.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

import numpy as np
import torch
from tqdm import tqdm

from dpledger.demo_story import story
from dpledger.harness import running_server
from dpledger.trainer.data import FederatedDataset
from dpledger.trainer.data.budgets import draw_budgets
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import (
    DPSGDConfig,
    FederatedAlgorithm,
    registry,
)
from dpledger.trainer.job import algorithm_args
from dpledger.trainer.loop import GatedSilo, JobRun, RoundRecord, run_gated
from dpledger.trainer.report import DemoSettings, write_report
from dpledger.wire.client import LedgerClient
from dpledger.wire.mechanisms import DpSgd
from dpledger.wire.schemas import SiloCreated

# The three points of the personalization spectrum the demo compares (names of the registry).
ALGORITHMS = ("local", "fedavg", "mrmtl")
BudgetSource = Literal["ladder", "MixGauss1", "MixGauss2", "MixGauss3"]
LADDER = (3.0, 12.0)  # the budgets' range: the cheapest silo buys ~1 round at σ = 1.2, the richest all 20


@dataclass(frozen=True)
class DemoConfig:
    silos: int = 10
    rounds: int = 20
    seed: int = 0  # the first seed; the demo runs seed, seed + 1, …, seed + seeds - 1
    seeds: int = 3
    out: Path = Path("dpledger-report")
    budgets: BudgetSource = "ladder"
    noise_multiplier: float = 1.2
    calibrate: bool = False
    delta: float = 1e-5
    # MR-MTL's λ, chosen by hand on this data (by its non-private test accuracy: 0.01 → 0.66, 0.1 → 0.54,
    # 1 → 0.34 after 20 rounds), not tuned privately; `dpledger tune` does that. Under the demo's DP
    # the order is the same (its mean over seeds 0-2: λ = 0.01 → 0.512, 0.1 → 0.370; local 0.541).
    lam: float = 0.01
    mask_probability: float = 0.1
    device: str = "cpu"
    progress: bool = True


def budget_ladder(silos: int) -> list[float]:
    """ε from LADDER[0] to LADDER[1], evenly spaced on a log scale, to two significant digits."""
    return [float(f"{e:.2g}") for e in np.geomspace(*LADDER, num=silos)]


def demo_budgets(config: DemoConfig) -> list[float]:
    if config.budgets == "ladder":
        return budget_ladder(config.silos)
    return [float(e) for e in draw_budgets(config.budgets, n_silos=config.silos, seed=config.seed).epsilons]


def build_algorithm(
    name: str, *, dataset: FederatedDataset, config: DPSGDConfig, noise_multipliers: list[float], lam: float, device: str
) -> FederatedAlgorithm:
    common = algorithm_args(dataset, config=config, noise_multipliers=noise_multipliers, device=device)
    return registry.build(name, common, {"lam": lam})


@dataclass(frozen=True)
class DemoRun:
    """Every seed's runs (seed → algorithm → its gated run) and the settings each seed ran with."""

    runs: dict[int, dict[str, JobRun]]
    settings: dict[int, DemoSettings]


def run_demo(config: DemoConfig) -> str:
    """Runs every seed, writes the first seed's report to `config.out` with the summary over seeds
    appended to its table.txt, and returns what the command prints."""
    return report(config, run_seeds(config))


def report(config: DemoConfig, demo: DemoRun) -> str:
    """Writes the first seed's report to `config.out` and the summary over seeds after its table
    (table.txt); returns what the command prints: that table, then the story lines."""
    first = min(demo.runs)
    table = write_report(config.out, demo.runs[first], demo.settings[first])
    text = table + "\n\n" + "\n".join(story(demo.runs, demo.settings[first]))
    (config.out / "table.txt").write_text(text + "\n")
    return text


def run_seeds(config: DemoConfig) -> DemoRun:
    """One ledger; per seed, fresh silos for each algorithm (same budgets) and its gated runs."""
    if config.seeds < 1:
        raise ValueError(f"seeds must be at least 1. Found {config.seeds}.")
    admin_key = secrets.token_urlsafe(32)
    threads = torch.get_num_threads()
    if config.device == "cpu":
        # Each DP-SGD step is a handful of tiny matrix products: a second thread buys nothing and
        # fights the ledger's process (on the same cores) for every round's approvals.
        torch.set_num_threads(1)
    # No receipts kept: the demo's ledger, and the key that signs its log, die with the demo.
    try:
        with tempfile.TemporaryDirectory(prefix="dpledger-demo-") as tmp, running_server(
            database_url=f"sqlite:///{tmp}/ledger.db", admin_key=admin_key
        ) as url, LedgerClient(url, admin_key, receipts=False) as admin:
            runs: dict[int, dict[str, JobRun]] = {}
            settings: dict[int, DemoSettings] = {}
            for seed in range(config.seed, config.seed + config.seeds):
                runs[seed], settings[seed] = _run_seed(config, seed, url=url, admin=admin)
    finally:
        torch.set_num_threads(threads)
    return DemoRun(runs, settings)


def _run_seed(config: DemoConfig, seed: int, *, url: str, admin: LedgerClient) -> tuple[dict[str, JobRun], DemoSettings]:
    dataset = make_rotated_masked_digits(n_silos=config.silos, seed=seed, mask_probability=config.mask_probability)
    budgets = demo_budgets(config)
    dpsgd = DPSGDConfig(seed=seed, noise_multiplier=config.noise_multiplier)
    tag = "" if seed == config.seed else f"-seed-{seed}"  # the first seed keeps the names it always had
    if config.calibrate:
        # The shape of each silo's workload, by dp-accounting alone; its σ is then calibrated
        # against the filter the silo commits to (below), which is what its gate reads.
        noise = _calibrated_noise(admin, dataset, budgets, dpsgd=dpsgd, rounds=config.rounds, delta=config.delta)
    else:
        noise = [config.noise_multiplier] * config.silos
    registered: dict[str, list[SiloCreated]] = {
        name: [
            admin.create_silo(name=f"{name}{tag}-silo-{k}", epsilon=budgets[k], delta=config.delta, dataset_size=s.n_train,
                              horizon=_round_of(dpsgd, n=s.n_train, noise_multiplier=noise[k]))
            for k, s in enumerate(dataset.silos)
        ]
        for name in ALGORITHMS
    }
    if config.calibrate:
        # Every algorithm's silo k has the same budget, size and horizon, hence the same filter.
        noise = [
            admin.calibrate_silo(s.id, batch_size=min(dpsgd.batch_size, d.n_train), steps_per_round=dpsgd.local_steps,
                                 rounds=config.rounds).noise_multiplier
            for s, d in zip(registered[ALGORITHMS[0]], dataset.silos, strict=True)
        ]
    runs: dict[str, JobRun] = {}
    for name in ALGORITHMS:
        algorithm = build_algorithm(
            name, dataset=dataset, config=dpsgd, noise_multipliers=noise, lam=config.lam, device=config.device
        )
        gated = [GatedSilo(s.id, LedgerClient(url, s.api_key, receipts=False)) for s in registered[name]]
        label = name if config.seeds == 1 else f"{name} seed {seed}"
        bar = tqdm(total=config.rounds, desc=f"{label:>14}", unit="round", disable=not config.progress)
        try:
            runs[name] = run_gated(algorithm, gated, rounds=config.rounds, job_id=f"demo-{name}{tag}", on_round=_advance(bar))
        finally:
            bar.close()
            for silo in gated:
                silo.client.close()

    settings = DemoSettings(
        silos=config.silos, rounds=config.rounds, seed=seed, budgets=config.budgets, epsilons=budgets,
        delta=config.delta, noise_multipliers=noise, calibrated=config.calibrate,
        sampling_rates=[min(1.0, dpsgd.batch_size / s.n_train) for s in dataset.silos],
        dataset_sizes=[s.n_train for s in dataset.silos], batch_size=dpsgd.batch_size, local_steps=dpsgd.local_steps,
        lr=dpsgd.lr, clip_norm=dpsgd.clip_norm, lam=config.lam, mask_probability=config.mask_probability,
        n_classes=int(dataset.n_classes or 0), device=config.device,
    )
    return runs, settings


def _round_of(dpsgd: DPSGDConfig, *, n: int, noise_multiplier: float) -> DpSgd:
    """One round of a silo of n records: its horizon (a silo smaller than the batch samples at q = 1)."""
    return DpSgd(noise_multiplier=noise_multiplier, steps=dpsgd.local_steps, batch_size=min(dpsgd.batch_size, n))


def _advance(bar: tqdm[NoReturn]) -> Callable[[RoundRecord], None]:
    """A round loop's callback that advances `bar` once per finished round, showing who still trains."""

    def on_round(record: RoundRecord) -> None:
        bar.set_postfix_str(f"silos training {sum(record.approved)}")
        bar.update()

    return on_round


def _calibrated_noise(
    admin: LedgerClient, dataset: FederatedDataset, budgets: list[float], *, dpsgd: DPSGDConfig, rounds: int, delta: float
) -> list[float]:
    """σ_k so that silo k's whole run costs its budget by dp-accounting over every order (the
    service's calibration never overshoots): the shape of the horizon a silo declares, before its
    filter is fixed. Silos with equal (ε, q) share one calibration."""
    cache: dict[tuple[float, float], float] = {}
    noise = []
    for budget, silo in zip(budgets, dataset.silos, strict=True):
        batch = min(dpsgd.batch_size, silo.n_train)
        key = (budget, batch / silo.n_train)
        if key not in cache:
            cache[key] = admin.calibrate(epsilon=budget, delta=delta, sampling_rate=key[1], steps=rounds * dpsgd.local_steps)
        noise.append(cache[key])
    return noise
