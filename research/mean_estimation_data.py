"""The mean-estimation federation of Liu et al. 2022 §6 ("Setup").

K silos, silo k holds n scalars x_{k,i} = w_k + z_{k,i} with z_{k,i} ~ N(0, σ²); the silo centers are
w_k = θ + z with z ~ N(0, τ²) around a fixed meta-center θ. A large τ² means heterogeneous silos.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dpledger.trainer.data import FederatedDataset, SiloData


def _check_count(name: str, value: int, *, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}. Found {value}.")


def _check_variance(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0. Found {value}.")


def draw_centers_and_points(
    rng: np.random.Generator,
    *,
    n_silos: int,
    n_per_silo: int,
    data_variance: float,
    heterogeneity: float,
    meta_center: float = 0.0,
    batch: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One draw (or `batch` independent draws) of Liu et al. 2022 §6's generative model.

    Returns (centers, points): centers w_k of shape (K,) and points x_{k,i} of shape (K, n), or
    (batch, K) and (batch, K, n). `data_variance` is σ², `heterogeneity` is τ² (variances, not
    standard deviations, as in the paper). This is the single implementation of the model: the
    data set below and the simulator in `trainer.mean_estimation_theory` both draw from it.
    """
    _check_count("n_silos", n_silos, minimum=1)
    _check_count("n_per_silo", n_per_silo, minimum=1)
    _check_variance("data_variance", data_variance)
    _check_variance("heterogeneity", heterogeneity)
    lead: tuple[int, ...] = () if batch is None else (batch,)
    # Liu et al. 2022 §6 Setup: w_k = θ + z, z ~ N(0, τ²).
    centers = meta_center + math.sqrt(heterogeneity) * rng.standard_normal((*lead, n_silos))
    # Liu et al. 2022 §6 Setup: x_{k,i} = w_k + z_{k,i}, z_{k,i} ~ N(0, σ²).
    points = centers[..., None] + math.sqrt(data_variance) * rng.standard_normal((*lead, n_silos, n_per_silo))
    return centers, points


@dataclass(frozen=True)
class MeanEstimationData:
    """The federation plus its hidden truth (the w_k and θ), which only evaluation may read."""

    dataset: FederatedDataset
    silo_centers: torch.Tensor
    meta_center: float


def make_mean_estimation(
    *,
    n_silos: int,
    n_per_silo: int,
    data_variance: float,
    heterogeneity: float,
    seed: int,
    n_test_per_silo: int = 1000,
    meta_center: float = 0.0,
) -> MeanEstimationData:
    """Liu et al. 2022 §6's federation as a `FederatedDataset` with task "mean".

    x tensors have shape (n, 1) (float64, so estimates can be compared with the closed forms
    without float32 rounding); there are no labels, so y tensors have shape (n, 0) and still
    index per example. The test points are fresh draws around the same w_k: the paper measures
    *generalization* error, on unseen points from the same local distribution.
    """
    _check_count("n_test_per_silo", n_test_per_silo, minimum=0)
    rng = np.random.default_rng(seed)
    centers, points = draw_centers_and_points(
        rng,
        n_silos=n_silos,
        n_per_silo=n_per_silo,
        data_variance=data_variance,
        heterogeneity=heterogeneity,
        meta_center=meta_center,
    )
    test_points = centers[:, None] + math.sqrt(data_variance) * rng.standard_normal((n_silos, n_test_per_silo))
    silos = [
        SiloData(
            silo_id=k,
            x_train=torch.from_numpy(points[k].reshape(-1, 1).copy()),
            y_train=torch.empty((n_per_silo, 0), dtype=torch.float64),
            x_test=torch.from_numpy(test_points[k].reshape(-1, 1).copy()),
            y_test=torch.empty((n_test_per_silo, 0), dtype=torch.float64),
            name=f"silo-{k}",
        )
        for k in range(n_silos)
    ]
    return MeanEstimationData(
        dataset=FederatedDataset(silos, task="mean", n_features=1, n_classes=None),
        silo_centers=torch.from_numpy(centers.copy()),
        meta_center=float(meta_center),
    )
