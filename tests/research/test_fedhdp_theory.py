"""FedHDP point estimation (FedHDP §3.1): the simulated server error against Lemma 1 and eq. (13)."""

from __future__ import annotations

import numpy as np
import pytest

from research.fedhdp_theory import (
    PointEstimationSetup,
    draw_updates,
    simulate_server_mse,
    two_step_estimate,
)

# FedHDP Fig. 1 (left): N = 20, ρ_np = 0.05 (one non-private client), σ_c² = α² + τ² = 11, γ² = 4;
# plus a setting with more non-private clients, where r* is larger and the curve flatter.
FIGURE_1 = PointEstimationSetup(n_clients=20, n_nonprivate=1, alpha2=10.0, tau2=1.0, gamma2=4.0)
QUARTER_OPT_OUT = PointEstimationSetup(n_clients=20, n_nonprivate=5, alpha2=1.0, tau2=0.5, gamma2=0.2)
SETUPS = [FIGURE_1, QUARTER_OPT_OUT]
IDS = ["figure-1", "quarter-opt-out"]
# Two-sided 4.5 standard errors: a false alarm rate of ~7e-6 per comparison.
Z = 4.5
TRIALS = 400_000


def log_grid(center: float) -> np.ndarray:
    """Ratios from center/e to center·e, ~2.5% apart: the grid steps are far finer than 10%."""
    return center * np.exp(np.linspace(-1.0, 1.0, 81))


@pytest.mark.parametrize("setup", SETUPS, ids=IDS)
def test_simulated_mse_is_lowest_within_10_percent_of_lemma_1_ratio(setup: PointEstimationSetup) -> None:
    r_star = setup.lemma1_ratio()
    grid = log_grid(r_star)
    for seed in range(3):
        result = simulate_server_mse(setup, ratios=grid, n_trials=TRIALS, seed=seed)
        best = float(grid[int(np.argmin(result.mse))])
        assert abs(best / r_star - 1.0) <= 0.10, (seed, best, r_star)
        # The curve does have a minimum inside the grid, rather than running off an edge.
        assert result.mse[0] > result.mse.min() and result.mse[-1] > result.mse.min()


@pytest.mark.parametrize("setup", SETUPS, ids=IDS)
def test_simulated_mse_at_lemma_1_ratio_matches_eq_13(setup: PointEstimationSetup) -> None:
    r_star = setup.lemma1_ratio()
    expected = setup.optimal_server_variance()
    for seed in range(3):
        result = simulate_server_mse(setup, ratios=[r_star], n_trials=TRIALS, seed=100 + seed)
        simulated, stderr = float(result.mse[0]), float(result.stderr[0])
        assert abs(simulated / expected - 1.0) <= 0.10, (seed, simulated, expected)
        # Far tighter than the 10% the issue asks: the formula is exact, not just close.
        assert abs(simulated - expected) <= Z * stderr, (seed, simulated, expected, stderr)
        assert stderr < 0.01 * expected


@pytest.mark.parametrize("setup", SETUPS, ids=IDS)
def test_simulated_mse_matches_the_closed_form_at_every_ratio(setup: PointEstimationSetup) -> None:
    grid = np.concatenate([[0.0] if setup.n_nonprivate else [], log_grid(setup.lemma1_ratio())[::10], [1.0]])
    result = simulate_server_mse(setup, ratios=grid, n_trials=TRIALS, seed=7)
    for ratio, simulated, stderr in zip(grid, result.mse, result.stderr, strict=True):
        expected = setup.server_variance(ratio=float(ratio))
        assert abs(simulated - expected) <= Z * stderr, (ratio, simulated, expected, stderr)


@pytest.mark.parametrize("setup", SETUPS, ids=IDS)
def test_eq_13_is_the_minimum_of_the_closed_form(setup: PointEstimationSetup) -> None:
    r_star = setup.lemma1_ratio()
    assert setup.server_variance(ratio=r_star) == pytest.approx(setup.optimal_server_variance(), rel=1e-12)
    for ratio in np.linspace(0.0 if setup.n_nonprivate else 0.01, 1.0, 101):
        assert setup.server_variance(ratio=float(ratio)) >= setup.optimal_server_variance() * (1 - 1e-12)


def test_lemma_1_ratio_formula() -> None:
    s = FIGURE_1
    assert s.lemma1_ratio() == pytest.approx(11.0 / (11.0 + 0.95 * 20 * 4.0), rel=1e-15)


def test_endpoints_recover_the_baselines_of_section_3_1_1() -> None:
    # r = 1 is HDP-FedAvg (every update weighs the same); Lemma 2, eq. (14) gives its gap to eq. (13).
    s = FIGURE_1
    rho, n, g2, sc = s.rho_np, s.n_clients, s.gamma2, s.client_variance
    gap = rho * (1 - rho) ** 3 * g2**2 * n / (sc + rho * (1 - rho) * g2 * n)
    assert s.server_variance(ratio=1.0) - s.optimal_server_variance() == pytest.approx(gap, rel=1e-12)
    # No private client, or no noise: r* = 1 and the server error is the plain (α²+τ²)/N.
    plain = PointEstimationSetup(n_clients=20, n_nonprivate=5, alpha2=1.0, tau2=0.5, gamma2=0.0)
    assert plain.lemma1_ratio() == 1.0
    assert plain.optimal_server_variance() == pytest.approx(1.5 / 20, rel=1e-12)


def test_generative_model_moments() -> None:
    # φ̂_j ~ N(φ, α² + τ²) whether drawn directly or as the mean of n_s observations of eq. (6), and a
    # private update adds (1 − ρ_np)Nγ².
    s = PointEstimationSetup(n_clients=4, n_nonprivate=2, alpha2=2.0, tau2=0.5, gamma2=0.25)
    direct = draw_updates(s, n_trials=200_000, rng=np.random.default_rng(1), phi=3.0)
    sampled = draw_updates(s, n_trials=50_000, rng=np.random.default_rng(2), phi=3.0, samples_per_client=8)
    for updates in (direct, sampled):
        n = updates.shape[0]
        tol = Z * np.sqrt(2.0 / n)  # relative standard error of a sample variance of Gaussians
        assert np.allclose(updates.mean(0), 3.0, atol=Z * np.sqrt(3.0 / n))
        assert np.allclose(updates[:, :2].var(0) / s.client_variance, 1.0, atol=tol)
        assert np.allclose(updates[:, 2:].var(0) / (s.client_variance + s.private_noise_variance), 1.0, atol=tol)


def test_two_step_estimate_weights() -> None:
    updates = np.array([[1.0, 2.0, 10.0, 20.0]])
    # (1 + 2 + r(10 + 20)) / (2 + 2r) at r = 0.5
    assert two_step_estimate(updates, n_nonprivate=2, ratio=0.5)[0] == pytest.approx(18.0 / 3.0)
    assert two_step_estimate(updates, n_nonprivate=2, ratio=0.0)[0] == pytest.approx(1.5)
    assert two_step_estimate(updates, n_nonprivate=2, ratio=1.0)[0] == pytest.approx(33.0 / 4.0)
    with pytest.raises(ValueError, match="ratio must be > 0"):
        two_step_estimate(updates, n_nonprivate=0, ratio=0.0)


def test_setup_validation() -> None:
    with pytest.raises(ValueError, match="n_nonprivate must be an integer in"):
        PointEstimationSetup(n_clients=3, n_nonprivate=4, alpha2=1.0, tau2=1.0, gamma2=1.0)
    with pytest.raises(ValueError, match="gamma2 must be a finite number >= 0"):
        PointEstimationSetup(n_clients=3, n_nonprivate=1, alpha2=1.0, tau2=1.0, gamma2=float("nan"))
    with pytest.raises(ValueError, match="alpha2 \\+ tau2 must be > 0"):
        PointEstimationSetup(n_clients=3, n_nonprivate=1, alpha2=0.0, tau2=0.0, gamma2=1.0)


def test_simulator_measures_the_two_step_estimator() -> None:
    # The simulator computes every ratio from shared group sums; it must equal the estimator itself
    # on the same draws.
    s = QUARTER_OPT_OUT
    ratios = [0.0, 0.3, 1.0]
    result = simulate_server_mse(s, ratios=ratios, n_trials=1000, seed=5, phi=-2.0)
    updates = draw_updates(s, n_trials=1000, rng=np.random.default_rng(5), phi=-2.0)
    for ratio, mse in zip(ratios, result.mse, strict=True):
        direct = np.mean((two_step_estimate(updates, n_nonprivate=s.n_nonprivate, ratio=ratio) + 2.0) ** 2)
        assert mse == pytest.approx(direct, rel=1e-10)
