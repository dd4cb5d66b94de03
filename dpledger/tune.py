"""`dpledger tune`: a private search over MR-MTL's λ (Liu et al. 2022 §7; Papernot & Steinke 2022).

Each silo asks the ledger for one search whose trial mechanism is its whole MR-MTL run (every
round's dpsgd, composed: `steps = rounds × local_steps`). The ledger charges repeat_and_select up
front and draws K_k; the worker then runs trials t = 0, 1, …, each a full MR-MTL run with λ drawn
from the grid, in which silo k trains only while t < K_k. The search's approval is the gate of
every round of its trials: the per-round charges of `trainer.loop` would charge the same queries a
second time, so a trial calls `run_round` directly with the search's approvals. Each silo reports
its score (test accuracy of its personalized model) after every trial it took part in; the ledger
commits the search at the K-th report. Only the best λ per silo is printed: that is all a
repeat-and-select search releases.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import secrets
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import MRMTL, DPSGDConfig
from dpledger.wire.client import LedgerClient
from dpledger.wire.errors import Denied
from dpledger.wire.searches import DistributionKind, SearchStarted


@dataclass(frozen=True)
class TuneConfig:
    grid: tuple[float, ...] = (0.0, 0.1, 1.0, 10.0)
    silos: int = 4
    rounds: int = 3
    mean_trials: float = 3.0
    distribution: DistributionKind = "geometric"
    shape: float | None = None
    epsilon: float = 20.0
    delta: float = 1e-5
    noise_multiplier: float = 1.0
    seed: int = 0
    device: str = "cpu"
    url: str | None = None
    admin_key: str | None = None

    def __post_init__(self) -> None:
        if not self.grid or not all(math.isfinite(lam) and lam >= 0 for lam in self.grid):
            raise ValueError(f"grid must be a non-empty list of finite λ >= 0. Found {list(self.grid)}.")
        if self.silos < 2:
            raise ValueError(f"silos must be at least 2 for MR-MTL. Found {self.silos}.")
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1. Found {self.rounds}.")


@dataclass(frozen=True)
class SiloOutcome:
    silo_id: int
    trials: int | None  # K drawn by the ledger; None when the search was refused
    best_lambda: float | None
    best_accuracy: float | None
    scores: list[tuple[float, float]] = field(default_factory=list)  # (λ, accuracy) of each trial


@contextmanager
def _ledger(config: TuneConfig) -> Iterator[tuple[str, str]]:
    if config.url is not None:
        admin_key = config.admin_key or os.environ.get("DPLEDGER_ADMIN_KEY")
        if not admin_key:
            raise ValueError("--url needs an admin key in DPLEDGER_ADMIN_KEY to register the silos")
        yield config.url, admin_key
        return
    from dpledger.harness import running_server

    admin_key = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="dpledger-tune-") as tmp, running_server(
        database_url=f"sqlite:///{tmp}/ledger.db", admin_key=admin_key
    ) as url:
        yield url, admin_key


def run_tune(config: TuneConfig) -> list[SiloOutcome]:
    dataset = make_rotated_masked_digits(n_silos=config.silos, seed=config.seed, mask_probability=0.1)
    dpsgd = DPSGDConfig(seed=config.seed, noise_multiplier=config.noise_multiplier)
    # λ is chosen by the worker from public hyperparameters only; a seeded stream keeps runs
    # reproducible, while K (which must stay unpredictable) comes from the ledger.
    pick = random.Random(config.seed)

    def build(lam: float, trial_index: int) -> MRMTL:
        return MRMTL(
            lam=lam, **dataset.tensors(),
            num_classes=dataset.n_classes, config=dataclasses.replace(dpsgd, seed=config.seed + trial_index),
            noise_multipliers=[config.noise_multiplier] * config.silos, device=config.device,
        )

    probe = build(config.grid[0], 0)
    with ExitStack() as stack:
        url, admin_key = stack.enter_context(_ledger(config))
        admin = stack.enter_context(LedgerClient(url, admin_key))
        run_id = secrets.token_hex(4)
        ids: list[int] = []
        clients: list[LedgerClient] = []
        for k, silo in enumerate(dataset.silos):
            created = admin.create_silo(name=f"tune-{run_id}-silo-{k}", epsilon=config.epsilon, delta=config.delta,
                                        dataset_size=silo.n_train)
            ids.append(created.id)
            clients.append(stack.enter_context(LedgerClient(url, created.api_key)))

        searches: list[SearchStarted | None] = []
        for k, client in enumerate(clients):
            # The whole run is one trial: rounds × local_steps Poisson-sampled Gaussian steps.
            trial = probe.samplers[k].mechanism(noise_multiplier=config.noise_multiplier,
                                                steps=config.rounds * dpsgd.local_steps)
            try:
                searches.append(client.start_search(ids[k], trial=trial, mean_trials=config.mean_trials,
                                                    distribution=config.distribution, shape=config.shape,
                                                    idempotency_key=f"tune-{run_id}-{k}"))
            except Denied:
                searches.append(None)
        trials = [0 if s is None else s.trials for s in searches]

        scores: list[list[tuple[float, float]]] = [[] for _ in clients]
        for t in range(max(trials, default=0)):
            lam = pick.choice(config.grid)
            algorithm = build(lam, t + 1)
            active = torch.tensor([t < k_drawn for k_drawn in trials], dtype=torch.bool)
            for round_index in range(config.rounds):
                algorithm.run_round(round_index, active)
            accuracy = algorithm.evaluate().tolist()
            for k, search in enumerate(searches):
                if search is not None and active[k]:
                    clients[k].report_trial(search.search_id, score=float(accuracy[k]))
                    scores[k].append((lam, float(accuracy[k])))

    outcomes = []
    for k in range(config.silos):
        best = max(scores[k], key=lambda pair: pair[1], default=None)
        outcomes.append(SiloOutcome(
            silo_id=ids[k], trials=None if searches[k] is None else trials[k],
            best_lambda=None if best is None else best[0], best_accuracy=None if best is None else best[1],
            scores=scores[k],
        ))
    return outcomes


def format_outcomes(outcomes: Sequence[SiloOutcome]) -> str:
    lines = [f"{'silo':>6} {'K':>4} {'best λ':>8} {'accuracy':>9}"]
    for o in outcomes:
        if o.trials is None:
            lines.append(f"{o.silo_id:>6} {'-':>4} {'refused: over budget':>18}")
        elif o.best_lambda is None:
            lines.append(f"{o.silo_id:>6} {o.trials:>4} {'no trial (K = 0)':>18}")
        else:
            lines.append(f"{o.silo_id:>6} {o.trials:>4} {o.best_lambda:>8g} {o.best_accuracy:>9.4f}")
    return "\n".join(lines)
