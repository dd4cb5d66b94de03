"""The synthetic additive-model regression of Bietti et al. 2022 §6 ("Synthetic dataset").

N users, d = 100. A random θ_0 ~ N(0, 10² I_d); user i's ground truth θ*_i shares the first 95
coordinates with θ_0 and perturbs the last 5: [θ*_i]_{96:100} = [θ_0]_{96:100} + δ_i,
δ_i ~ N(0, 0.01² I). Samples: x ~ N(0, Σ), Σ = diag(λ_k), λ_k = 1/k; y = θ*_i·x + ε, ε ~ N(0, τ²).

Reading of the extracted text: "N(0, 102Id)" and "N(0, 0.012I)" are 10² I_d and 0.01² I with the
superscripts flattened (the authors' released code draws `10. * randn(d)` and `0.01 * randn`).
The paper leaves the label-noise τ unstated; the default 0.01 is the value in that code.
The paper runs one online pass with fresh samples, so the number of samples per user is a knob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dpledger.trainer.data import FederatedDataset, SiloData

PAPER_N_USERS = 1000
PAPER_DIM = 100
PAPER_N_SHARED = 95
PAPER_THETA0_STD = 10.0
PAPER_LOCAL_STD = 0.01


@dataclass(frozen=True)
class AdditiveRegressionData:
    """The federation plus its ground truth, for the closed-form excess risk of Bietti et al. 2022 §6."""

    dataset: FederatedDataset
    theta0: torch.Tensor
    user_thetas: torch.Tensor
    feature_variances: torch.Tensor

    def excess_risk(self, *, global_params: torch.Tensor, local_params: torch.Tensor) -> float:
        """(1/N) Σ_i ‖w + θ_i − θ*_i‖²_Σ (Bietti et al. 2022 §6): the additive model predicts (w + θ_i)·x,
        and with x ~ N(0, Σ) the excess squared loss over the noise floor τ² is exactly that norm."""
        if global_params.shape != self.theta0.shape:
            raise ValueError(
                f"global_params must have shape {tuple(self.theta0.shape)}. Found {tuple(global_params.shape)}."
            )
        if local_params.shape != self.user_thetas.shape:
            raise ValueError(
                f"local_params must have shape {tuple(self.user_thetas.shape)}. Found {tuple(local_params.shape)}."
            )
        gap = global_params.to(torch.float64)[None, :] + local_params.to(torch.float64) - self.user_thetas
        return float((gap.square() * self.feature_variances[None, :]).sum(dim=1).mean())


def make_additive_regression(
    *,
    seed: int,
    n_users: int = PAPER_N_USERS,
    dim: int = PAPER_DIM,
    n_shared: int = PAPER_N_SHARED,
    n_train_per_user: int = 50,
    n_test_per_user: int = 50,
    theta0_std: float = PAPER_THETA0_STD,
    local_std: float = PAPER_LOCAL_STD,
    label_noise_std: float = 0.01,
) -> AdditiveRegressionData:
    """Bietti et al. 2022 §6's synthetic regression as a `FederatedDataset` (task "regression").

    x: (n, dim) float32, y: (n,) float32. Ground truth is kept in float64.
    """
    for name, count, minimum in (
        ("n_users", n_users, 1),
        ("dim", dim, 1),
        ("n_train_per_user", n_train_per_user, 1),
        ("n_test_per_user", n_test_per_user, 0),
    ):
        if count < minimum:
            raise ValueError(f"{name} must be at least {minimum}. Found {count}.")
    if not 0 <= n_shared <= dim:
        raise ValueError(f"n_shared must be in [0, dim={dim}]. Found {n_shared}.")
    for name, value in (("theta0_std", theta0_std), ("local_std", local_std), ("label_noise_std", label_noise_std)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0. Found {value}.")

    rng = np.random.default_rng(seed)
    theta0 = theta0_std * rng.standard_normal(dim)
    # Coordinates 1..n_shared (1-based in the paper) are shared; the rest get a per-user offset δ_i.
    offsets = np.zeros((n_users, dim))
    offsets[:, n_shared:] = local_std * rng.standard_normal((n_users, dim - n_shared))
    user_thetas = theta0[None, :] + offsets
    # Σ = diag(1/k), k = 1..d: a decaying spectrum, so later coordinates (the personal ones) are
    # the hardest to learn from few samples.
    feature_variances = 1.0 / np.arange(1, dim + 1, dtype=np.float64)
    feature_stds = np.sqrt(feature_variances)

    def draw(user: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = rng.standard_normal((count, dim)) * feature_stds[None, :]
        y = x @ user_thetas[user] + label_noise_std * rng.standard_normal(count)
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))

    silos = []
    for user in range(n_users):
        x_train, y_train = draw(user, n_train_per_user)
        x_test, y_test = draw(user, n_test_per_user)
        silos.append(
            SiloData(
                silo_id=user, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, name=f"user-{user}"
            )
        )
    return AdditiveRegressionData(
        dataset=FederatedDataset(silos, task="regression", n_features=dim, n_classes=None),
        theta0=torch.from_numpy(theta0),
        user_thetas=torch.from_numpy(user_thetas),
        feature_variances=torch.from_numpy(feature_variances),
    )
