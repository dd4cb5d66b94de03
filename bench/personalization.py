"""Liu et al. 2022's personalization baselines at one common budget, every round gated by a real ledger:
local, FedAvg, local finetuning, Ditto, IFCA (every round and first 10%), MR-MTL and MR-MTL
warm-started by IFCA (Liu et al. 2022 Fig. 3, 4 and 6).

    python bench/personalization.py            # 20 silos, 30 rounds, seeds 0-2 (~6 min on 2 cores)
    python bench/personalization.py --quick    # 1 seed, 8 silos, 8 rounds, one λ (< 30 s)

Setup per seed s: `make_rotated_masked_digits(n_silos, seed=s, mask_probability=p)` (four rotation
groups, silo-specific masks: Liu et al. 2022 §5's two layers). Every silo has the same budget (ε, δ).
Alignment on the budget follows Liu et al. 2022 §4 ("restricting the total number of iterations ... then
account for any privacy overheads"): the DP-SGD noise σ is calibrated through the ledger so that
R rounds of E plain DP-SGD steps spend exactly ε; every method uses that σ and is gated round by
round, so a method with overhead (Ditto's E_p extra steps, IFCA's cluster selection) is refused
by the ledger before round R and stops there, its models frozen. The table reports how many rounds
each method got.

- Local, FedAvg, MR-MTL(λ): R rounds of dpsgd(q, σ, E).
- Finetuning: FedAvg for the first half of the rounds, local DP-SGD after (Liu et al. 2022 Fig. 2).
- Ditto(λ, E_p): dpsgd(q, σ, E + E_p) per round (Liu et al. 2022 §4).
- IFCA: selection in every round, charged as dpsgd(q_s = 1, σ_s, 1) on top (see
  `trainer/federated/ifca.py`); IFCA (10%): selection in the first ⌈0.1·R⌉ rounds only.
- MR-MTL warm-started: IFCA (10%), then MR-MTL(λ) inside each cluster (Liu et al. 2022 §5, Fig. 6).

λ of MR-MTL, Ditto and the warm-started MR-MTL is the best of `--lams` by mean accuracy over seeds
(Liu et al. 2022's λ*): that choice reads the test sets and is not charged (issue 5's searches charge it),
so those three rows are optimistic in the same way. Accuracy: mean over silos of each silo's
deployed model on its own test set after the last round; mean ± std over seeds. "purity" is the
share of silos whose IFCA cluster's majority rotation group is their own.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from dpledger.harness import running_server
from dpledger.trainer.data import FederatedDataset
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import (
    IFCA,
    MRMTL,
    ClusteredMRMTL,
    ClusterSelection,
    Ditto,
    DPSGDConfig,
    FedAvg,
    FederatedAlgorithm,
    Finetuning,
    LocalTraining,
    clustering_rounds,
)
from dpledger.trainer.loop import GatedSilo, run_gated
from dpledger.wire.client import LedgerClient

DELTA = 1e-5
CLUSTERS = 4  # the four rotation groups


@dataclass
class Outcome:
    accuracy: float
    rounds: float  # mean over silos of the rounds approved
    purity: float | None = None


@dataclass
class Results:
    by_method: dict[str, list[Outcome]] = field(default_factory=dict)

    def add(self, method: str, outcome: Outcome) -> None:
        self.by_method.setdefault(method, []).append(outcome)

    def mean_accuracy(self, method: str) -> float:
        return statistics.fmean(o.accuracy for o in self.by_method[method])


def purity(assignment: list[int], groups: list[int]) -> float:
    agree = 0
    for cluster in set(assignment):
        members = [g for a, g in zip(assignment, groups, strict=True) if a == cluster]
        agree += Counter(members).most_common(1)[0][1]
    return agree / len(groups)


def common_args(dataset: FederatedDataset, config: DPSGDConfig) -> dict[str, Any]:
    return {
        **dataset.tensors(),
        "num_classes": dataset.n_classes, "config": config,
    }


@dataclass
class SeedBench:
    admin: LedgerClient
    url: str
    seed: int
    dataset: FederatedDataset
    config: DPSGDConfig
    rounds: int
    epsilon: float

    def run(self, method: str, algorithm: FederatedAlgorithm) -> Outcome:
        prefix = f"s{self.seed}-{method}"
        created = [
            self.admin.create_silo(name=f"{prefix}-{k}", epsilon=self.epsilon, delta=DELTA, dataset_size=s.n_train)
            for k, s in enumerate(self.dataset.silos)
        ]
        silos = [GatedSilo(c.id, LedgerClient(self.url, c.api_key)) for c in created]
        try:
            run = run_gated(algorithm, silos, rounds=self.rounds, job_id=prefix)
        finally:
            for silo in silos:
                silo.client.close()
        if run.stop_reason is not None and not all(run.stopped):
            raise RuntimeError(f"{method}: {run.stop_reason}")
        final = float(np.nanmean(algorithm.evaluate().numpy()))
        groups = [s.group for s in self.dataset.silos]
        assignment = getattr(algorithm, "assignment", None)
        return Outcome(
            accuracy=final,
            rounds=statistics.fmean(run.approved_rounds()),
            purity=None if assignment is None else purity(assignment.tolist(), groups),
        )


def methods(args: argparse.Namespace, lams: list[float], base: dict[str, Any]) -> dict[str, Callable[[], FederatedAlgorithm]]:
    selection = ClusterSelection(noise_multiplier=args.selection_sigma, loss_clip=args.loss_clip)
    warm = clustering_rounds(0.1, args.rounds)
    table: dict[str, Callable[[], FederatedAlgorithm]] = {
        "Local": lambda: LocalTraining(**base),
        "FedAvg": lambda: FedAvg(**base),
        "Finetuning (FedAvg 50%)": lambda: Finetuning(federated_rounds=args.rounds // 2, **base),
        "IFCA (every round)": lambda: IFCA(clusters=CLUSTERS, selection=selection, **base),
        "IFCA (10%)": lambda: IFCA(clusters=CLUSTERS, selection=selection, selection_rounds=warm, **base),
    }
    for lam in lams:
        table[f"Ditto λ={lam:g}"] = lambda lam=lam: Ditto(lam=lam, personal_steps=args.personal_steps, **base)
        table[f"MR-MTL λ={lam:g}"] = lambda lam=lam: MRMTL(lam=lam, **base)
        table[f"MR-MTL (IFCA 10%) λ={lam:g}"] = lambda lam=lam: ClusteredMRMTL(
            lam=lam, clusters=CLUSTERS, selection=selection, selection_rounds=warm, **base
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--silos", type=int, default=20, help="silos (rotation group k mod 4)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=8.0, help="every silo's ε (δ = 1e-5)")
    parser.add_argument("--mask-probability", type=float, default=0.1, help="Liu et al. 2022 §5's second layer")
    parser.add_argument("--lr", type=float, default=0.15)
    parser.add_argument("--local-steps", type=int, default=10, help="E")
    parser.add_argument("--personal-steps", type=int, default=5, help="Ditto's E_p")
    parser.add_argument("--lams", default="0.001,0.003,0.01,0.03", help="λ grid of MR-MTL, Ditto, warm-started MR-MTL")
    parser.add_argument("--selection-sigma", type=float, default=3.0, help="σ_s of IFCA's selection")
    parser.add_argument("--loss-clip", type=float, default=5.0, help="C_ℓ of IFCA's selection")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 silos, 8 rounds, λ = 0.03")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.silos, args.rounds, args.lams = 1, 8, 8, "0.03"
    lams = [float(v) for v in args.lams.split(",")]
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    admin_key = secrets.token_urlsafe(32)
    results = Results()
    sigmas: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dpledger-personalization-") as tmp, running_server(
        database_url=f"sqlite:///{tmp}/ledger.db", admin_key=admin_key
    ) as url, LedgerClient(url, admin_key) as admin:
        for seed in range(args.seeds):
            dataset = make_rotated_masked_digits(n_silos=args.silos, seed=seed, mask_probability=args.mask_probability)
            sizes = {s.n_train for s in dataset.silos}
            # Silos of unequal size would need one σ each; the IID split gives sizes within one record,
            # so the smallest silo's (largest) q sets one σ that keeps every silo within ε.
            q = min(16, min(sizes)) / min(sizes)
            sigma = admin.calibrate(epsilon=args.epsilon, delta=DELTA, sampling_rate=q, steps=args.rounds * args.local_steps)
            sigmas.append(sigma)
            config = DPSGDConfig(seed=seed, lr=args.lr, local_steps=args.local_steps, noise_multiplier=sigma)
            bench = SeedBench(
                admin=admin, url=url, seed=seed, dataset=dataset, config=config, rounds=args.rounds, epsilon=args.epsilon
            )
            for method, build in methods(args, lams, common_args(dataset, config)).items():
                outcome = bench.run(method, build())
                results.add(method, outcome)
                extra = "" if outcome.purity is None else f", purity {outcome.purity:.2f}"
                print(f"seed {seed} {method:<28} acc {100 * outcome.accuracy:5.1f}%  rounds {outcome.rounds:5.1f}{extra}  "
                      f"[{time.monotonic() - started:.0f} s]", flush=True)

    print()
    print(f"digits, {args.silos} silos in 4 rotation groups, mask p={args.mask_probability:g}; every silo ε={args.epsilon:g}, "
          f"δ={DELTA:g}; σ={statistics.fmean(sigmas):.3f} calibrated for {args.rounds} rounds × {args.local_steps} steps; "
          f"IFCA selection σ_s={args.selection_sigma:g} on every record; seeds 0-{args.seeds - 1}")
    best = {
        family: max(lams, key=lambda lam: results.mean_accuracy(f"{family} λ={lam:g}"))
        for family in ("Ditto", "MR-MTL", "MR-MTL (IFCA 10%)")
    }
    rows = ["Local", "FedAvg", "Finetuning (FedAvg 50%)", f"Ditto λ={best['Ditto']:g}", "IFCA (every round)", "IFCA (10%)",
            f"MR-MTL λ={best['MR-MTL']:g}", f"MR-MTL (IFCA 10%) λ={best['MR-MTL (IFCA 10%)']:g}"]
    header = f"| {'method':<30} | {'acc %':>6} | {'std':>5} | {'rounds':>6} | {'purity':>6} | " + " | ".join(
        f"seed {s}" for s in range(args.seeds)) + " |"
    print(header)
    print("|" + "-" * (len(header) - 2) + "|")
    for method in rows:
        outcomes = results.by_method[method]
        values = [100 * o.accuracy for o in outcomes]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        purities = [o.purity for o in outcomes if o.purity is not None]
        shown = f"{statistics.fmean(purities):6.2f}" if purities else f"{'':>6}"
        print(
            f"| {method:<30} | {statistics.fmean(values):6.1f} | {spread:5.1f} | "
            f"{statistics.fmean(o.rounds for o in outcomes):6.1f} | {shown} | " + " | ".join(f"{v:6.1f}" for v in values) + " |"
        )
    print()
    for family in ("Ditto", "MR-MTL", "MR-MTL (IFCA 10%)"):
        grid = ", ".join(f"λ={lam:g}: {100 * results.mean_accuracy(f'{family} λ={lam:g}'):.1f}" for lam in lams)
        print(f"{family} λ grid (mean %): {grid}")
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
