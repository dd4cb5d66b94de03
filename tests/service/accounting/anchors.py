"""Two fixed workloads the gate is measured on.

R1: one DP-SGD run, q = 256/60000, σ = 1.1, 14,062 steps, δ = 1e-5 (MNIST-sized, about 60 epochs).

H1000: a 1,000-charge heterogeneous history of DP-SGD charges, drawn once with
numpy.random.default_rng(1000): for each charge, in this order, q uniformly from H1000_RATES,
σ uniformly from H1000_NOISE, and steps uniformly from 1..16. Large-ε and low-order (its best order
is below 2), so it is where dp-accounting's fractional-order series is loosest.
"""

from __future__ import annotations

import numpy as np

from dpledger.wire.mechanisms import DpSgd

R1 = DpSgd(noise_multiplier=1.1, steps=14_062, sampling_rate=256 / 60_000)
R1_DELTA = 1e-5
R1_TODAY = 2.5966  # dp-accounting's ε, 4 decimals (the table)

H1000_SEED = 1000
H1000_RATES = (0.005, 0.01, 0.02, 0.05, 0.1)
H1000_NOISE = (0.6, 0.8, 1.0, 1.2)
H1000_MAX_STEPS = 16
H1000_DELTA = 1e-5
# dp-accounting's ε of H1000 at δ = 1e-5 (compute_epsilon over its default orders), pinned when the
# anchor was drawn; test_h1000 recomputes it.
H1000_TODAY = 101.17988697498787


def h1000() -> list[DpSgd]:
    rng = np.random.default_rng(H1000_SEED)
    charges = []
    for _ in range(1000):
        q = float(rng.choice(H1000_RATES))
        sigma = float(rng.choice(H1000_NOISE))
        steps = int(rng.integers(1, H1000_MAX_STEPS + 1))
        charges.append(DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q))
    return charges
