"""The budget check before and after the proven gate, side by side: it must stay O(orders).

    python bench/gate_check.py            # histories of 10, 1,000 and 100,000 charges (~20 s)
    python bench/gate_check.py --quick    # 10 and 1,000 (~5 s)

For each history length N, a running sum of N DP-SGD charges (drawn with numpy's default_rng(0):
q from {0.004, 0.01, 0.05}, σ from {0.8, 1.0, 1.2}, 1..20 steps) is built once, then the check one
more charge costs is timed, in-process and interleaved, on the same running sum:

- before: the old rule, dp-accounting's compute_epsilon over all 156 orders at the whole δ, on the
  running sum read from its stored JSON as the ledger reads it.
- after (default filter): ledger/charges.py `check_budget` with the silo's default filter (156
  orders, 0.9 on the committed one), the check reserve() makes under the silo lock (running sum and
  filter read from the silo row, as in the ledger).
- after (legacy filter): the same with the 156-order union bound migrated silos get.
- replay: what O(history) would cost, composing the N charges' curves again (shown for scale).

Printed: µs per check, the ratio after/before at each N, and for each way the ratio of its time at
the largest N to its time at N = 10 (≈ 1 means independent of history).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger import charges
from dpledger.service.store.models import Silo
from dpledger.wire.mechanisms import DpSgd

DELTA = 1e-5


def history(n: int) -> list[DpSgd]:
    rng = np.random.default_rng(0)
    return [
        DpSgd(noise_multiplier=float(rng.choice((0.8, 1.0, 1.2))), steps=int(rng.integers(1, 21)),
              sampling_rate=float(rng.choice((0.004, 0.01, 0.05))))
        for _ in range(n)
    ]


def per_call(fn: Callable[[], object], *, repeats: int) -> float:
    """Median over 5 rounds of the mean time of `repeats` calls, in µs."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(rounds)


def measure(n: int) -> dict[str, float]:
    step = DpSgd(noise_multiplier=1.0, steps=1, sampling_rate=0.01)
    step_curve = rdp.certified_curve(step)
    curves = [rdp.certified_curve(m) for m in history(n)]
    running = RunningSum.empty(len(rdp.ORDERS))
    for c in curves:
        running = running.add(c)
    budget = rdp.epsilon(running.curve(), delta=DELTA)[0] * 2  # approvals succeed: the whole check runs
    default_spec = rdp_filter.default_spec(epsilon=budget, delta=DELTA, dataset_size=60_000)
    stored = running.to_json()
    default = Silo(epsilon=budget, delta=DELTA, plan=None, plan_used=0, filter_seq=1, filter_spec=default_spec.to_json(),
                   rdp_spent=stored)
    legacy_spec = rdp_filter.legacy_spec()
    legacy = Silo(epsilon=budget, delta=DELTA, plan=None, plan_used=0, filter_seq=1, filter_spec=legacy_spec.to_json(),
                  rdp_spent=stored)

    def before() -> object:
        candidate = RunningSum.from_json(stored).add(step_curve)
        eps, _ = rdp.epsilon(candidate.curve(), delta=DELTA)
        return rdp.within_budget(eps, budget=budget)

    def after(silo: Silo) -> Callable[[], object]:
        return lambda: charges.check_budget(silo, step_curve).fits

    out: dict[str, float] = {}
    for _ in range(2):  # interleaved twice; the second pass is kept
        out["before"] = per_call(before, repeats=300)
        out["after (default filter)"] = per_call(after(default), repeats=300)
        out["after (legacy filter)"] = per_call(after(legacy), repeats=300)
    subset = curves[: min(n, 1_000)]
    out["replay"] = per_call(lambda: rdp.epsilon(np.sum(subset, axis=0), delta=DELTA), repeats=20) * n / len(subset)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [10, 1_000] if args.quick else [10, 1_000, 100_000]

    results: dict[str, dict[int, float]] = {"before": {}, "after (default filter)": {}, "after (legacy filter)": {}, "replay": {}}
    for n in sizes:
        for name, value in measure(n).items():
            results[name][n] = value

    print(f"{'check':<26}" + "".join(f"{f'N={n:,}':>14}" for n in sizes) + f"{'N=' + format(sizes[-1], ',') + ' / N=10':>18}")
    for name, row in results.items():
        print(f"{name + ' (µs)':<26}" + "".join(f"{row[n]:>14.1f}" for n in sizes) + f"{row[sizes[-1]] / row[10]:>18.2f}")
    for name in ("after (default filter)", "after (legacy filter)"):
        print(f"{name + ' / before':<26}" + "".join(f"{results[name][n] / results['before'][n]:>14.2f}" for n in sizes))
    print(json.dumps({"bench": "gate_check", "sizes": sizes, "us_per_check": results}))


if __name__ == "__main__":
    main()
