"""Liu et al. 2022 §7, Fig. 7 logic on mean estimation: does privately tuning λ pay for itself?

Setup of Liu et al. 2022 §6: K silos, n points each, data variance σ², heterogeneity τ², clip c, and each
silo releases its local sum plus Gaussian noise of std z·c (sensitivity c). For every silo's budget
(ε, δ) we compare, at the same budget:

- local training (λ = 0) and FedAvg (λ = ∞), untuned: one release, z calibrated to (ε, δ);
- MR-MTL at λ* with tuning *not* paid for ("Private" in Fig. 7);
- MR-MTL tuned with a random number of trials (Papernot & Steinke 2022): the trial's z calibrated so
  that repeat_and_select(Gaussian(z), mean = 10, shape) costs (ε, δ) as a whole, and the error at the
  best λ of the grid under that larger noise ("Private, TNB/Poisson" in Fig. 7).

Errors are the closed form E(λ) of Lemma 6.7 (`MeanEstimationSetting.mse`); the search is credited
with finding the grid's best λ exactly, so the tuned rows are optimistic for tuning. Calibration is a
bisection over dp-accounting RDP curves that returns the noisier end (never over budget).

    python bench/tuning_cost.py [--quick] [--out tuning_cost.png]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.service.accounting import rdp
from dpledger.service.accounting.trial_counts import Shape
from dpledger.wire.mechanisms import AnyMechanism, Gaussian, RepeatAndSelect

from research.mean_estimation_theory import MeanEstimationSetting

MEAN_TRIALS = 10.0
LAWS: list[tuple[str, Shape]] = [("poisson", "infinity"), ("geometric", 1.0), ("logarithmic", 0.0), ("tnb η=0.5", 0.5)]


def epsilon_of(mechanism: AnyMechanism, *, delta: float) -> float:
    return rdp.epsilon(rdp.rdp_curve(mechanism), delta=delta)[0]


def calibrate(*, shape: Shape | None, epsilon: float, delta: float, tol: float) -> float:
    """Smallest z (to relative `tol`) whose mechanism costs ≤ ε at δ; returns the noisier end."""

    def cost(z: float) -> float:
        trial = Gaussian(noise_multiplier=z)
        mechanism: AnyMechanism = trial if shape is None else RepeatAndSelect(event=trial, mean=MEAN_TRIALS, shape=shape)
        return epsilon_of(mechanism, delta=delta)

    low, high = 1e-2, 1.0
    while cost(high) > epsilon:
        low, high = high, high * 2
    while high - low > tol * high:
        mid = math.sqrt(low * high)
        if cost(mid) > epsilon:
            low = mid
        else:
            high = mid
    assert cost(high) <= epsilon * (1 + 1e-9)
    return high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="coarser calibration and λ grid (< 60 s)")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--silos", type=int, default=10)
    parser.add_argument("--n", type=int, default=50, help="points per silo")
    parser.add_argument("--data-variance", type=float, default=1.0)
    parser.add_argument("--heterogeneity", type=float, default=0.02)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("tuning_cost.png"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tol = 1e-3 if args.quick else 1e-5
    grid = np.concatenate([[0.0], np.logspace(-3, 3, 25 if args.quick else 121)])

    def setting(z: float) -> MeanEstimationSetting:
        return MeanEstimationSetting(n_silos=args.silos, n=args.n, data_variance=args.data_variance,
                                     heterogeneity=args.heterogeneity, dp_noise_variance=(z * args.clip) ** 2)

    z_once = calibrate(shape=None, epsilon=args.epsilon, delta=args.delta, tol=tol)
    base = setting(z_once)
    rows = [
        ("local (λ=0)", z_once, base.mse(0.0), "-"),
        ("FedAvg (λ=∞)", z_once, base.mse(math.inf), "-"),
        ("MR-MTL λ*, tuning unpaid", z_once, base.optimal_mse, f"{base.optimal_lambda:.3g}"),
    ]
    curves = {"Private (tuning unpaid)": [base.mse(float(lam)) for lam in grid]}
    for name, shape in LAWS:
        z = calibrate(shape=shape, epsilon=args.epsilon, delta=args.delta, tol=tol)
        tuned = setting(z)
        errors = [tuned.mse(float(lam)) for lam in grid]
        best = int(np.argmin(errors))
        rows.append((f"MR-MTL tuned, {name}", z, errors[best], f"{grid[best]:.3g}"))
        curves[f"Private, {name}"] = errors

    endpoint = min(base.mse(0.0), base.mse(math.inf))
    header = (
        f"ε={args.epsilon:g} δ={args.delta:g} K={args.silos} n={args.n} "
        f"σ²={args.data_variance:g} τ²={args.heterogeneity:g} E[h]={MEAN_TRIALS:g}"
    )
    lines = [header, f"{'method':<30} {'noise z':>9} {'error E(λ)':>11} {'vs best endpoint':>17} {'λ':>8}"]
    for name, z, error, lam in rows:
        lines.append(f"{name:<30} {z:>9.4f} {error:>11.5f} {error / endpoint:>16.3f}x {lam:>8}")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    shown = np.where(grid == 0, grid[1] / 3, grid)  # λ = 0 drawn at the left edge of the log axis
    for label, errors in curves.items():
        axis.plot(shown, errors, label=label, lw=2 if "unpaid" in label else 1.2)
    axis.axhline(base.mse(0.0), color="gray", ls=":", label="local (λ=0)")
    axis.axhline(base.mse(math.inf), color="black", ls="--", label="FedAvg (λ=∞)")
    axis.set_xscale("log")
    axis.set_xlabel("λ")
    axis.set_ylabel("error E(λ) (Lemma 6.7)")
    axis.set_title("Cost of tuning λ, Liu et al. 2022 Fig. 7 logic")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"\nplot: {args.out}  ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
