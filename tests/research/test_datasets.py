"""The research data generators: mean estimation
("On Privacy and Personalization in Cross-Silo Federated Learning", §6) and the additive model
("Personalization Improves Privacy-Accuracy Tradeoffs in Federated Learning", §6)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from tests.trainer.test_data import Z, assert_same_dataset

from research.additive_data import make_additive_regression
from research.mean_estimation_data import make_mean_estimation


def test_mean_estimation_shapes_determinism_and_model() -> None:
    kwargs: dict[str, Any] = dict(n_silos=400, n_per_silo=50, data_variance=4.0, heterogeneity=0.5, seed=7, n_test_per_silo=30)
    data = make_mean_estimation(meta_center=3.0, **kwargs)
    again = make_mean_estimation(meta_center=3.0, **kwargs)
    assert_same_dataset(data.dataset, again.dataset)
    assert torch.equal(data.silo_centers, again.silo_centers)
    silo = data.dataset[0]
    assert silo.x_train.shape == (50, 1) and silo.y_train.shape == (50, 0)
    assert silo.x_test.shape == (30, 1) and data.dataset.task == "mean" and data.dataset.n_classes is None

    centers = data.silo_centers.numpy()
    # w_k ~ N(θ, τ²): mean and variance of 400 centers.
    assert abs(centers.mean() - 3.0) <= Z * math.sqrt(0.5 / 400)
    assert abs(centers.var(ddof=1) - 0.5) <= Z * 0.5 * math.sqrt(2 / 399)
    # x_{k,i} − w_k ~ N(0, σ²), for train and for the fresh test points alike.
    for split in ("x_train", "x_test"):
        residuals = np.concatenate(
            [getattr(s, split)[:, 0].numpy() - w for s, w in zip(data.dataset.silos, centers, strict=True)]
        )
        assert abs(residuals.mean()) <= Z * math.sqrt(4.0 / residuals.size)
        assert abs(residuals.var() - 4.0) <= Z * 4.0 * math.sqrt(2 / (residuals.size - 1))


# --- Bietti et al. 2022 §6 additive model ----------------------------------------------------------------


def test_additive_regression_follows_the_paper_recipe() -> None:
    data = make_additive_regression(seed=3, n_users=200, n_train_per_user=40, n_test_per_user=10)
    dataset = data.dataset
    assert dataset.task == "regression" and dataset.n_features == 100 and dataset.n_silos == 200
    assert dataset[0].x_train.shape == (40, 100) and dataset[0].y_train.shape == (40,)
    assert dataset[0].x_test.shape == (10, 100) and dataset[0].x_train.dtype == torch.float32

    thetas, theta0 = data.user_thetas.numpy(), data.theta0.numpy()
    # Coordinates 1..95 are θ_0's for every user; 96..100 are θ_0 + δ_i, δ_i ~ N(0, 0.01² I).
    assert np.array_equal(thetas[:, :95], np.broadcast_to(theta0[:95], (200, 95)))
    offsets = (thetas[:, 95:] - theta0[95:]).ravel()
    assert abs(offsets.std() - 0.01) <= Z * 0.01 / math.sqrt(2 * offsets.size)
    assert abs(theta0.std() - 10.0) <= Z * 10.0 / math.sqrt(2 * 100)

    x = torch.cat([s.x_train for s in dataset.silos]).double().numpy()
    # Σ = diag(1/k).
    variances = x.var(axis=0)
    expected = 1.0 / np.arange(1, 101)
    assert np.all(np.abs(variances - expected) <= Z * expected * math.sqrt(2 / x.shape[0]))
    # y = θ*_i·x + ε, ε ~ N(0, 0.01²): the residual is the label noise (float32 rounding of y,
    # whose scale is ~|θ_0|·‖x‖ ≈ 30, adds ~1e-6, far below 0.01).
    residuals = np.concatenate(
        [s.y_train.double().numpy() - s.x_train.double().numpy() @ thetas[i] for i, s in enumerate(dataset.silos)]
    )
    assert abs(residuals.std() - 0.01) < 0.001

    # Excess risk: zero at the truth; for the global-only fit θ_0 it is the Σ-norm of the offsets.
    global_only = data.excess_risk(global_params=data.theta0, local_params=torch.zeros_like(data.user_thetas))
    assert global_only == pytest.approx(float(np.mean(((thetas - theta0) ** 2 * expected).sum(axis=1))))
    assert data.excess_risk(global_params=torch.zeros(100), local_params=data.user_thetas) == 0.0

    again = make_additive_regression(seed=3, n_users=200, n_train_per_user=40, n_test_per_user=10)
    assert_same_dataset(dataset, again.dataset)
    other = make_additive_regression(seed=4, n_users=2)
    assert not torch.equal(other.theta0, make_additive_regression(seed=3, n_users=2).theta0)


def test_additive_regression_defaults_are_the_papers() -> None:
    data = make_additive_regression(seed=0, n_train_per_user=1, n_test_per_user=1)
    assert data.dataset.n_silos == 1000 and data.dataset.n_features == 100
    assert data.user_thetas.shape == (1000, 100)
    assert torch.equal(data.user_thetas[:, :95], data.theta0[:95].expand(1000, 95))
    assert not torch.equal(data.user_thetas[:, 95:], data.theta0[95:].expand(1000, 5))
