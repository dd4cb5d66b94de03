"""Reports beside the ledger: DP-SGD noise calibration (never overshoots, and tight), the PLD ε for
audits, zCDP ρ, and the budget check's rounding slack."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from mpmath import mp

from dpledger.service.accounting import rdp, reports
from dpledger.service.accounting.events import resolve
from dpledger.wire.mechanisms import (
    AnyMechanism,
    Composed,
    DpSgd,
    Gaussian,
    Laplace,
    PoissonSampled,
    RepeatAndSelect,
    SelfComposed,
    ZCdp,
)
from tests.service.accounting.exact_rdp import exact_epsilon, exact_rdp

ORDERS = np.array(rdp.ORDERS)


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def calibration_targets() -> list[tuple[float, float, float, int]]:
    rng = random.Random(424242)
    targets = [
        (
            log_uniform(rng, 0.5, 8.0),
            log_uniform(rng, 1e-7, 1e-4),
            log_uniform(rng, 1e-3, 0.05),
            round(log_uniform(rng, 10, 5000)),
        )
        for _ in range(10)
    ]
    return [*targets, (2.0, 1e-5, 0.01, 500), (1.0, 1e-5, 1.0, 1)]  # the API test's case; a full-batch Gaussian


@pytest.mark.parametrize(("epsilon", "delta", "q", "steps"), calibration_targets())
def test_calibrated_noise_never_overshoots_and_is_tight(epsilon: float, delta: float, q: float, steps: int) -> None:
    sigma, eps = reports.calibrate_dpsgd_noise(epsilon=epsilon, delta=delta, sampling_rate=q, steps=steps)
    assert 0 < sigma and math.isfinite(sigma)
    # never overshoots: the ε it reports is the ledger's certified reading of that σ, within the target
    planned = DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q)
    assert eps <= epsilon
    assert eps == rdp.guarantee(rdp.certified_curve(planned), delta=delta).epsilon
    assert rdp.within_budget(eps, budget=epsilon)
    # sound: at the order it reads, the exact ε of that σ (50-digit reference) is no higher
    order = rdp.guarantee(rdp.certified_curve(planned), delta=delta).order
    assert mp.mpf(eps) >= exact_epsilon(order, steps * exact_rdp(q, sigma, order), delta)
    # dp-accounting's reading agrees to 1e-4 (it reads above the exact value at some fractional orders)
    reference = reports.dpsgd_epsilon(noise_multiplier=sigma, sampling_rate=q, steps=steps, delta=delta)
    assert reference == pytest.approx(eps, rel=1e-4)
    # tight: 0.01% less noise already spends more than the target, by the ledger and by dp-accounting
    fewer = DpSgd(noise_multiplier=sigma * (1 - 1e-4), steps=steps, sampling_rate=q)
    assert rdp.guarantee(rdp.certified_curve(fewer), delta=delta).epsilon > epsilon
    assert reports.dpsgd_epsilon(noise_multiplier=sigma * (1 - 1e-4), sampling_rate=q, steps=steps, delta=delta) > epsilon


def test_more_budget_never_asks_for_more_noise() -> None:
    sigmas = [reports.calibrate_dpsgd_noise(epsilon=e, delta=1e-5, sampling_rate=0.01, steps=300)[0] for e in (0.5, 1.0, 4.0)]
    assert sigmas[0] > sigmas[1] > sigmas[2]


def test_dpsgd_epsilon_is_the_ledgers_epsilon() -> None:
    for sigma, q, steps in [(1.3, 0.0025, 6000), (0.9, 0.05, 40), (4.0, 1.0, 3)]:
        curve = rdp.rdp_curve(DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q))
        for delta in (1e-5, 1e-9):
            assert reports.dpsgd_epsilon(noise_multiplier=sigma, sampling_rate=q, steps=steps, delta=delta) == rdp.epsilon(
                curve, delta=delta
            )[0]


# --- PLD ------------------------------------------------------------------------------------------------

PLD_SUPPORTED: list[AnyMechanism] = [
    DpSgd(noise_multiplier=1.5, steps=1000, sampling_rate=0.01),
    DpSgd(noise_multiplier=1.0, steps=200, sampling_rate=0.05),
    DpSgd(noise_multiplier=1.3, steps=600, sampling_rate=0.0025),
    resolve(DpSgd(noise_multiplier=2.0, steps=300, batch_size=64), dataset_size=5000),
    PoissonSampled(sampling_rate=0.02, event=Gaussian(noise_multiplier=1.2)),
    SelfComposed(count=50, event=PoissonSampled(sampling_rate=0.02, event=Gaussian(noise_multiplier=1.2))),
    Gaussian(noise_multiplier=2.0),
    Laplace(noise_multiplier=2.0),
]


@pytest.mark.parametrize("m", PLD_SUPPORTED, ids=lambda m: m.type)
@pytest.mark.parametrize("delta", [1e-5, 1e-7])
def test_pld_epsilon_is_at_most_the_rdp_epsilon(m: AnyMechanism, delta: float) -> None:
    report = reports.pld_epsilon(m, delta=delta)
    assert report.unsupported_reason is None
    assert report.epsilon is not None and report.epsilon > 0
    rdp_eps, _ = rdp.epsilon(rdp.rdp_curve(m), delta=delta)
    assert report.epsilon <= rdp_eps


def test_pld_of_a_pure_dp_laplace_is_at_most_its_pure_epsilon() -> None:
    report = reports.pld_epsilon(Laplace(noise_multiplier=2.0), delta=1e-6)
    assert report.epsilon is not None
    assert report.epsilon <= 0.5 + reports.PLD_DISCRETIZATION  # ε₀ = 1/b, up to the PLD grid


@pytest.mark.parametrize(
    ("m", "event_name"),
    [
        (ZCdp(rho=0.1), "ZCDpEvent"),
        (ZCdp(rho=0.1, xi=0.01), "ZCDpEvent"),
        (RepeatAndSelect(event=Gaussian(noise_multiplier=2.0), mean=10, shape=1), "RepeatAndSelectDpEvent"),
        (RepeatAndSelect(event=Laplace(noise_multiplier=2.0), mean=3, shape="infinity"), "RepeatAndSelectDpEvent"),
        (
            RepeatAndSelect(event=DpSgd(noise_multiplier=1, steps=10, sampling_rate=0.01), mean=3, shape=0),
            "RepeatAndSelectDpEvent",
        ),
        (Composed(events=[DpSgd(noise_multiplier=1, steps=10, sampling_rate=0.01), ZCdp(rho=0.1)]), "DpEvent"),
    ],
)
def test_pld_explains_what_it_cannot_report(m: AnyMechanism, event_name: str) -> None:
    report = reports.pld_epsilon(m, delta=1e-5)
    assert report.epsilon is None
    assert isinstance(report.unsupported_reason, str)
    assert "PLD" in report.unsupported_reason and event_name in report.unsupported_reason


# --- zCDP ρ ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m",
    [
        ZCdp(rho=0.3),
        ZCdp(rho=0.3, xi=0.2),
        Gaussian(noise_multiplier=1.7),
        Laplace(noise_multiplier=1.0),
        DpSgd(noise_multiplier=1.5, steps=100, sampling_rate=0.01),
        RepeatAndSelect(event=Gaussian(noise_multiplier=4.0), mean=5, shape=2),
    ],
    ids=lambda m: m.type,
)
def test_rho_is_the_largest_ratio_of_rdp_to_order(m: AnyMechanism) -> None:
    curve = rdp.rdp_curve(m)
    rho = rdp.rho(curve)
    assert rho is not None
    assert rho == float(np.max(curve / ORDERS))
    assert np.all(curve <= rho * ORDERS)  # (α, ρα)-RDP at every order of the grid
    assert rdp.guarantee(curve, delta=1e-5).rho == rho


def test_rho_of_known_curves() -> None:
    assert math.isclose(rdp.rho(rdp.rdp_curve(ZCdp(rho=0.3))), 0.3, rel_tol=1e-12)  # type: ignore[arg-type]
    # ξ + ρα over α is largest at the smallest order, 1.1
    assert math.isclose(rdp.rho(rdp.rdp_curve(ZCdp(rho=0.3, xi=0.2))), 0.3 + 0.2 / 1.1, rel_tol=1e-12)  # type: ignore[arg-type]
    # the Gaussian is exactly 1/(2σ²)-zCDP
    assert math.isclose(rdp.rho(rdp.rdp_curve(Gaussian(noise_multiplier=1.7))), 1 / (2 * 1.7**2), rel_tol=1e-12)  # type: ignore[arg-type]


def test_rho_is_none_where_the_curve_is_infinite() -> None:
    curve = rdp.rdp_curve(PoissonSampled(sampling_rate=0.05, event=Gaussian(noise_multiplier=0.7)))
    assert np.any(np.isinf(curve)) and not np.all(np.isinf(curve))
    assert rdp.rho(curve) is None
    assert rdp.guarantee(curve, delta=1e-5).rho is None
    one_inf = rdp.zero_curve()
    one_inf[-1] = np.inf
    assert rdp.rho(one_inf) is None
    assert rdp.rho(rdp.zero_curve()) == 0.0


def test_guarantee_is_epsilon_order_and_rho() -> None:
    curve = rdp.rdp_curve(DpSgd(noise_multiplier=1.3, steps=6000, sampling_rate=0.0025))
    g = rdp.guarantee(curve, delta=1e-5)
    theirs, order = rdp.epsilon(curve, delta=1e-5)
    # dp-accounting's conversion read on its safe side: never below it, above it by rounding only.
    assert g.order == order and theirs <= g.epsilon <= theirs * (1 + 1e-12)
    assert g.order == 19.0 and g.rho == rdp.rho(curve)


# --- the budget check ---------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1e-3, 0.1, 1.0, 3.7, 8.0, 1e4])
def test_within_budget_has_no_tolerance(budget: float) -> None:
    # Issue 13, item 9: the old 1e-9 relative tolerance let a silo exceed its budget.
    assert rdp.within_budget(budget, budget=budget)
    assert rdp.within_budget(budget * (1 - 1e-9), budget=budget)
    assert not rdp.within_budget(math.nextafter(budget, math.inf), budget=budget)
    assert not rdp.within_budget(budget * (1 + 1e-10), budget=budget)
    assert not rdp.within_budget(budget * (1 + 1e-8), budget=budget)
    assert not rdp.within_budget(budget * 2, budget=budget)
    assert not rdp.within_budget(math.inf, budget=budget)
    assert not rdp.within_budget(math.nan, budget=budget)
    assert rdp.within_budget(0.0, budget=budget)
