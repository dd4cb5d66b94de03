"""Certified curves stay certified (issue: sound by construction): the ledger's RDP of a Poisson-sampled
Gaussian step never reads below the exact value, at any order, over a seeded family of hard corners
(q near 1, q ≤ 1e-5, σ 0.5–0.7 and 20–300, orders 1.1–1024, 10⁶–10⁷ steps), against a 50-digit
mpmath reference (exact_rdp.py); and it stays tight: within 1e-3 of the exact value in the corners,
within 1e-8 over the workloads the tightness bench samples (q 4e-4 … 0.5, σ 0.6–3). A stated ε may
exceed dp-accounting's by float noise where dp-accounting reads below the exact value; it is never
below the exact conversion of the exact curve at its order."""

from __future__ import annotations

import mpmath as mp
import numpy as np
import pytest

from dpledger.service.accounting import conversion, rdp
from dpledger.service.accounting import filter as rdp_filter
from tests.service.accounting.exact_rdp import exact_epsilon, exact_rdp

ORDERS = list(rdp.ORDERS)


def hard_corners(count: int, seed: int) -> list[tuple[float, float, float, int]]:
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        u, v = rng.random(), rng.random()
        tiny, mid = 10 ** rng.uniform(-7, -5), 10 ** rng.uniform(-4, -0.3)
        q = 1 - 10 ** rng.uniform(-3, -0.5) if u < 0.25 else (tiny if u < 0.6 else mid)
        large = 10 ** rng.uniform(np.log10(20), np.log10(300))
        sigma = rng.uniform(0.5, 0.7) if v < 0.35 else (large if v < 0.7 else rng.uniform(0.7, 5))
        steps = 1 if rng.random() < 0.5 else int(10 ** rng.uniform(6, 7))
        cases.append((float(q), float(sigma), ORDERS[int(rng.integers(len(ORDERS)))], steps))
    return cases


@pytest.mark.parametrize(("q", "sigma", "alpha", "steps"), hard_corners(16, seed=40))
def test_the_ledgers_curve_is_never_below_the_exact_divergence_and_tight(
    q: float, sigma: float, alpha: float, steps: int
) -> None:
    step = rdp._sampled_gaussian(q, sigma, certified=True)
    value = float(rdp.times(steps, step)[ORDERS.index(alpha)])
    exact = exact_rdp(q, sigma, alpha)
    with mp.workdps(50):
        assert mp.mpf(float(step[ORDERS.index(alpha)])) >= exact, (q, sigma, alpha)
        assert mp.mpf(value) >= steps * exact, (q, sigma, alpha, steps)
        if np.isfinite(value):
            # Tight too: 5e-4 at worst (q < 1e-5 with σ < 0.7 at a fractional order), ~1e-9 elsewhere.
            assert (mp.mpf(value) - steps * exact) / (steps * exact) <= 1e-3, (q, sigma, alpha)


@pytest.mark.parametrize("seed", [1, 2])
def test_over_the_benchs_workloads_the_certificate_is_within_1e_8_of_exact(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(3):
        q, sigma = float(10 ** rng.uniform(-3.4, -0.3)), float(rng.uniform(0.6, 3.0))
        alpha = ORDERS[int(rng.integers(0, 100))]  # 1.1 … 11: where these workloads' best orders lie
        value = mp.mpf(float(rdp._sampled_gaussian(q, sigma, certified=True)[ORDERS.index(alpha)]))
        exact = exact_rdp(q, sigma, alpha)
        assert exact <= value <= exact * (1 + mp.mpf(1e-8)), (q, sigma, alpha)


def test_a_sum_within_rounding_of_the_kl_threshold_is_read_above_it() -> None:
    """The issue's silo of 10⁶ records: one charge of batch 1, σ 300, 1,176,114 steps; at order 15 the
    exact sum lies just above the KL branch's threshold for a share of 0.99 of δ = 1e-5, where the
    ledger read ε = 0. Read on its safe side, the ledger's ε is at least the exact conversion."""
    q, sigma, steps, alpha, delta = 1e-6, 300.0, 1_176_114, 15.0, 1e-5 * 0.99
    value = rdp.times(steps, rdp._sampled_gaussian(q, sigma, certified=True))[ORDERS.index(alpha)]
    exact_sum = steps * exact_rdp(q, sigma, alpha)
    exact = exact_epsilon(alpha, exact_sum, delta)
    ours = conversion.order_epsilons(np.array([alpha]), np.array([value]), np.array([delta]))[0]
    assert exact > 0.5 and ours >= exact
    # And at the threshold itself: a value one ulp above it converts to ε > 0, never to 0.
    threshold = float(-mp.log1p(-mp.mpf(delta) ** 2))
    above = np.nextafter(threshold, np.inf)
    assert conversion.order_epsilons(np.array([alpha]), np.array([above]), np.array([delta]))[0] > 0


def test_the_issues_quote_states_at_least_the_exact_value_at_its_order() -> None:
    """POST /v1/quote's `epsilon` (best order, whole δ) for σ 0.6857, q 2e-5, 944,762 steps: it read
    0.9907094585 at order 9.6, below the exact 0.9907094606."""
    from dpledger.wire.mechanisms import DpSgd

    curve = rdp.certified_curve(DpSgd(noise_multiplier=0.6857, steps=944_762, sampling_rate=2e-5))
    stated = rdp.guarantee(curve, delta=1e-5)
    exact = exact_epsilon(stated.order, 944_762 * exact_rdp(2e-5, 0.6857, stated.order), 1e-5)
    assert mp.mpf(stated.epsilon) >= exact
    assert (mp.mpf(stated.epsilon) - exact) / exact <= 1e-6
    # Read by a filter too: never below the exact conversion at the share the filter gives its order.
    spec = rdp_filter.legacy_spec()
    reading = rdp_filter.read(spec, curve, delta=1e-5)
    share = spec.weights[spec.orders.index(reading.order)]
    exact_sum = 944_762 * exact_rdp(2e-5, 0.6857, reading.order)
    exact_at = exact_epsilon(reading.order, exact_sum, float(np.nextafter(1e-5 * share, 0)))
    assert mp.mpf(reading.epsilon) >= exact_at
