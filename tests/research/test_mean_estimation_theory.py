"""MR-MTL(λ) mean estimation (Liu et al. 2022 §6): closed forms against simulation, and the endpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest

from research.mean_estimation_data import make_mean_estimation
from research.mean_estimation_theory import (
    MeanEstimationSetting,
    gaussian_mechanism_noise_std,
    mr_mtl_estimates,
    mr_mtl_weight,
    release_local_means,
    simulate_mse,
)

# σ_loc² = 1/20 + 20/400 = 0.1 = τ², so λ* = 1: local training and FedAvg are both clearly worse.
PRIVATE = MeanEstimationSetting(n_silos=10, n=20, data_variance=1.0, heterogeneity=0.1, dp_noise_variance=20.0)
NON_PRIVATE = MeanEstimationSetting(n_silos=10, n=20, data_variance=1.0, heterogeneity=0.1, dp_noise_variance=0.0)
LAMBDAS = [0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0, math.inf]
# Two-sided 4.5 standard errors: a per-comparison false alarm rate of ~7e-6, so even with a
# Bonferroni correction over the 16 comparisons below a correct formula fails < 1e-4 of the time.
Z = 4.5


@pytest.mark.parametrize("setting", [PRIVATE, NON_PRIVATE], ids=["private", "non-private"])
def test_simulated_mse_matches_lemma_6_7(setting: MeanEstimationSetting) -> None:
    result = simulate_mse(setting, lambdas=LAMBDAS, trials=20_000, seed=11)
    for lam, simulated, stderr in zip(LAMBDAS, result.mse, result.stderr, strict=True):
        expected = setting.mse(lam)
        assert abs(simulated - expected) <= Z * stderr, (lam, simulated, expected, stderr)
        # The standard error is itself small, so the check above is not vacuous.
        assert stderr < 0.02 * expected


def test_empirical_best_lambda_is_near_theorem_6_3() -> None:
    # A grid that does not depend on λ*: log-spaced over four decades, ~1.2% apart.
    grid = np.geomspace(0.01, 100.0, 801)
    settings = [
        MeanEstimationSetting(n_silos=10, n=20, data_variance=1.0, heterogeneity=0.25, dp_noise_variance=5.0),
        PRIVATE,
        MeanEstimationSetting(n_silos=8, n=10, data_variance=2.0, heterogeneity=0.05, dp_noise_variance=30.0),
    ]
    for setting in settings:
        best = [grid[np.argmin(simulate_mse(setting, lambdas=grid, trials=2_000, seed=seed).mse)] for seed in range(6)]
        expected = setting.optimal_lambda
        assert abs(float(np.mean(best)) - expected) <= 0.25 * expected, (setting, best, expected)


def test_optimal_lambda_formula_and_growth_with_privacy_noise() -> None:
    # Thm 6.3: λ* = (σ² + σ_DP²/n)/(nτ²) = σ_loc²/τ².
    assert PRIVATE.optimal_lambda == pytest.approx((1.0 + 20.0 / 20) / (20 * 0.1))
    assert PRIVATE.optimal_lambda == pytest.approx(PRIVATE.local_variance / PRIVATE.heterogeneity)
    assert NON_PRIVATE.optimal_lambda == pytest.approx(0.5)
    assert PRIVATE.optimal_lambda > NON_PRIVATE.optimal_lambda  # stronger privacy: federate more
    identical = MeanEstimationSetting(n_silos=3, n=5, data_variance=1.0, heterogeneity=0.0, dp_noise_variance=1.0)
    assert identical.optimal_lambda == math.inf


@pytest.mark.parametrize("setting", [PRIVATE, NON_PRIVATE], ids=["private", "non-private"])
def test_closed_forms_are_consistent(setting: MeanEstimationSetting) -> None:
    lam_star = setting.optimal_lambda
    # Thm 6.3 is the argmin of Lemma 6.7, and Cor. 6.4 is its value there.
    grid = np.geomspace(1e-3, 1e3, 20001)
    assert grid[np.argmin([setting.mse(float(lam)) for lam in grid])] == pytest.approx(lam_star, rel=1e-3)
    assert setting.mse(lam_star) == pytest.approx(setting.optimal_mse, rel=1e-12)
    # Local training (λ = 0) has error σ_loc² and gap Prop. 6.5; FedAvg (λ = ∞) has gap Prop. 6.6.
    assert setting.mse(0.0) == pytest.approx(setting.local_variance, rel=1e-12)
    assert setting.mse(0.0) - setting.optimal_mse == pytest.approx(setting.local_gap, rel=1e-10)
    assert setting.mse(math.inf) - setting.optimal_mse == pytest.approx(setting.fedavg_gap, rel=1e-10, abs=1e-15)
    assert setting.mse(1e9) == pytest.approx(setting.mse(math.inf), rel=1e-6)


def test_privacy_cost_matches_theorem_6_8() -> None:
    for lam in LAMBDAS:
        assert PRIVATE.mse(lam) - NON_PRIVATE.mse(lam) == pytest.approx(PRIVATE.privacy_cost(lam), rel=1e-10)
    # Thm 6.8: federating shrinks the privacy cost by up to a factor K.
    assert PRIVATE.privacy_cost(0.0) / PRIVATE.privacy_cost(math.inf) == pytest.approx(PRIVATE.n_silos)


def test_lambda_zero_is_exactly_local_training() -> None:
    data = make_mean_estimation(n_silos=7, n_per_silo=15, data_variance=1.0, heterogeneity=0.3, seed=3)
    points = np.stack([silo.x_train[:, 0].numpy() for silo in data.dataset.silos])
    released = release_local_means(points, dp_noise_variance=4.0, rng=np.random.default_rng(0))
    assert mr_mtl_weight(lam=0.0, n_silos=7) == 1.0
    assert np.array_equal(mr_mtl_estimates(released, lam=0.0), released)
    result = simulate_mse(PRIVATE, lambdas=[0.0], trials=5_000, seed=2)
    assert abs(result.mse[0] - PRIVATE.local_variance) <= Z * result.stderr[0]


def test_lambda_to_infinity_approaches_fedavg() -> None:
    released = np.random.default_rng(5).normal(size=(3, 9))
    fedavg = np.broadcast_to(released.mean(axis=-1, keepdims=True), released.shape)
    assert np.allclose(mr_mtl_estimates(released, lam=math.inf), fedavg, rtol=0.0, atol=1e-12)
    distances = [np.abs(mr_mtl_estimates(released, lam=lam) - fedavg).max() for lam in (1.0, 10.0, 1e3, 1e6)]
    assert distances == sorted(distances, reverse=True)
    assert distances[-1] < 1e-5
    # Lemma 6.1: 1 − α = λ(K − 1)/((1 + λ)K), so the gap to FedAvg falls like 1/(1 + λ).
    assert mr_mtl_weight(lam=1e6, n_silos=9) == pytest.approx(1 / 9, rel=1e-5)


def test_released_mean_noise_is_sigma_dp_squared_over_n_squared() -> None:
    # The reading stated in the module: ξ_k is added to the sum, so the mean carries σ_DP²/n².
    n, dp_variance = 25, 50.0
    points = np.zeros((200_000, 1, n))
    released = release_local_means(points, dp_noise_variance=dp_variance, rng=np.random.default_rng(1))
    expected = dp_variance / n**2
    # Var of a sample variance of m normals is 2σ⁴/(m − 1); 5 standard errors.
    assert abs(released.var() - expected) <= 5 * expected * math.sqrt(2 / (released.size - 1))


def test_gaussian_mechanism_noise_std() -> None:
    assert gaussian_mechanism_noise_std(epsilon=0.5, delta=1e-5, clip=2.0) == pytest.approx(
        2.0 * math.sqrt(2 * math.log(1.25e5)) / 0.5
    )
    with pytest.raises(ValueError, match=r"epsilon must be in \(0, 1\).*Found 1.5"):
        gaussian_mechanism_noise_std(epsilon=1.5, delta=1e-5, clip=1.0)


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"lam must be >= 0.*Found -1\.0"):
        mr_mtl_weight(lam=-1.0, n_silos=3)
    with pytest.raises(ValueError, match=r"n_silos must be at least 2.*Found 1"):
        MeanEstimationSetting(n_silos=1, n=5, data_variance=1.0, heterogeneity=1.0, dp_noise_variance=0.0)
    with pytest.raises(ValueError, match=r"heterogeneity must be a finite number >= 0.*Found -0\.1"):
        MeanEstimationSetting(n_silos=3, n=5, data_variance=1.0, heterogeneity=-0.1, dp_noise_variance=0.0)
    with pytest.raises(ValueError, match="lam must be >= 0"):
        simulate_mse(PRIVATE, lambdas=[1.0, float("nan")], trials=10, seed=0)
