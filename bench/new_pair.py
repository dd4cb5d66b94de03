"""The certified RDP curve of a new (q, σ) pair, side by side with dp-accounting alone (issue 26).

A training job's first round, or any new batch size or noise, asks the ledger for a (q, σ) pair it
has not seen: its curve at all 156 orders is computed on the approval path. This times, for fresh
pairs (never cached), the ledger's curve (rdp.certified_curve: sampled_gaussian.py's certified bound,
kept wherever it is finite; dp-accounting's value from reference_curve.py only where it is not) next to dp-accounting's
RdpAccountant on the same step, CPU time of this process, median and max over the pairs.

    python bench/new_pair.py [--pairs 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import rdp
from dpledger.wire.mechanisms import DpSgd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    args = parser.parse_args()
    rdp.certified_curve(DpSgd(sampling_rate=0.0101, noise_multiplier=1.01, steps=1))  # imports, scipy warm-up
    ours, theirs = [], []
    for i in range(args.pairs):
        q, sigma = 0.002 + 0.2 * i / args.pairs, 0.6 + 2.4 * ((i * 7) % args.pairs) / args.pairs + 1e-7 * i
        started = time.process_time()
        rdp.certified_curve(DpSgd(sampling_rate=q, noise_multiplier=sigma, steps=1))
        ours.append(time.process_time() - started)
        started = time.process_time()
        accountant = rdp_lib.RdpAccountant(list(rdp.ORDERS))
        accountant.compose(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)))
        theirs.append(time.process_time() - started)
    print(f"{'new (q, σ) pair, CPU ms':<28}{'median':>8}{'max':>8}")
    for name, times in (("ledger certified curve", ours), ("dp-accounting alone", theirs)):
        print(f"{name:<28}{1e3 * statistics.median(times):>8.1f}{1e3 * max(times):>8.1f}")
    print(f"ratio of medians: {statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()
