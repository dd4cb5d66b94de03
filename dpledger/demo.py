"""`dpledger demo`: the whole product on one machine.

Starts the ledger on a temporary SQLite file on a free port of 127.0.0.1, registers K digits silos
whose budgets are drawn from paper 001's MixGauss1 (Table 1), calibrates each silo's DP-SGD noise to
its own budget through the service, and runs local training, FedAvg and MR-MTL with every round
approved over real HTTP. Each algorithm is a separate job on separate ledgers with the same budgets,
as three alternative uses of the same promise would be.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm

from dpledger.harness import running_server
from dpledger.trainer.client import LedgerClient
from dpledger.trainer.data import FederatedDataset
from dpledger.trainer.data.budgets import MixtureName, draw_budgets
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import (
    DPSGDConfig,
    FederatedAlgorithm,
    registry,
)
from dpledger.trainer.job import algorithm_args
from dpledger.trainer.loop import GatedSilo, JobRun, RoundRecord, run_gated
from dpledger.trainer.report import (
    SiloRow,
    format_table,
    plot_accuracy,
    plot_epsilon,
    write_metrics,
)

# The three points of the personalization spectrum the demo compares (names of the registry).
ALGORITHMS = ("local", "fedavg", "mrmtl")


@dataclass(frozen=True)
class DemoConfig:
    silos: int = 10
    rounds: int = 20
    seed: int = 0
    out: Path = Path("dpledger-report")
    mixture: MixtureName = "MixGauss1"
    delta: float = 1e-5
    lam: float = 1.0
    mask_probability: float = 0.1
    device: str = "cpu"
    progress: bool = True


def build_algorithm(
    name: str, *, dataset: FederatedDataset, config: DPSGDConfig, noise_multipliers: list[float], lam: float, device: str
) -> FederatedAlgorithm:
    common = algorithm_args(dataset, config=config, noise_multipliers=noise_multipliers, device=device)
    return registry.build(name, common, {"lam": lam})


def run_demo(config: DemoConfig) -> str:
    dataset = make_rotated_masked_digits(n_silos=config.silos, seed=config.seed, mask_probability=config.mask_probability)
    budgets = [float(e) for e in draw_budgets(config.mixture, n_silos=config.silos, seed=config.seed).epsilons]
    dpsgd = DPSGDConfig(seed=config.seed)
    admin_key = secrets.token_urlsafe(32)
    config.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="dpledger-demo-") as tmp, running_server(
        database_url=f"sqlite:///{tmp}/ledger.db", admin_key=admin_key
    ) as url, LedgerClient(url, admin_key) as admin:
        noise = _calibrated_noise(admin, dataset, budgets, dpsgd=dpsgd, rounds=config.rounds, delta=config.delta)
        runs: dict[str, JobRun] = {}
        for name in ALGORITHMS:
            algorithm = build_algorithm(
                name, dataset=dataset, config=dpsgd, noise_multipliers=noise, lam=config.lam, device=config.device
            )
            silos = [
                admin.create_silo(name=f"{name}-silo-{k}", epsilon=budgets[k], delta=config.delta, dataset_size=s.n_train)
                for k, s in enumerate(dataset.silos)
            ]
            gated = [GatedSilo(s.id, LedgerClient(url, s.api_key)) for s in silos]
            bar = tqdm(total=config.rounds, desc=f"{name:>7}", unit="round", disable=not config.progress)
            try:
                runs[name] = run_gated(
                    algorithm, gated, rounds=config.rounds, job_id=f"demo-{name}", on_round=_ticks(bar)
                )
            finally:
                bar.close()
                for silo in gated:
                    silo.client.close()

    main = runs["mrmtl"]
    write_metrics(config.out / "metrics.jsonl", runs, budgets=budgets)
    plot_accuracy(config.out / "accuracy.png", runs)
    plot_epsilon(config.out / "epsilon.png", main, budgets=budgets, algorithm="mrmtl")
    rows = [
        SiloRow(
            name=f"silo-{k}", budget=budgets[k],
            epsilon_spent=main.rounds[-1].epsilon_spent[k] if main.rounds else 0.0,
            approved=main.approved_rounds()[k], refused=main.refused_rounds()[k],
            final={name: run.rounds[-1].metric[k] for name, run in runs.items()},
        )
        for k in range(config.silos)
    ]
    table = format_table(rows, ALGORITHMS)
    (config.out / "table.txt").write_text(table + "\n")
    return table


def _ticks(bar: tqdm[NoReturn]) -> Callable[[RoundRecord], None]:
    """A round loop's callback that advances `bar` once per finished round."""

    def tick(_record: RoundRecord) -> None:
        bar.update()

    return tick


def _calibrated_noise(
    admin: LedgerClient, dataset: FederatedDataset, budgets: list[float], *, dpsgd: DPSGDConfig, rounds: int, delta: float
) -> list[float]:
    """σ_k so that silo k's whole run costs exactly its budget (the service's calibration never
    overshoots); silos with equal (ε, q) share one calibration."""
    cache: dict[tuple[float, float], float] = {}
    noise = []
    for budget, silo in zip(budgets, dataset.silos, strict=True):
        batch = min(dpsgd.batch_size, silo.n_train)
        key = (budget, batch / silo.n_train)
        if key not in cache:
            cache[key] = admin.calibrate(epsilon=budget, delta=delta, sampling_rate=key[1], steps=rounds * dpsgd.local_steps)
        noise.append(cache[key])
    return noise
