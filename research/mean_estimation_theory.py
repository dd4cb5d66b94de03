"""MR-MTL(λ) for private mean estimation: the closed forms of Liu et al. 2022 §6 and a Monte Carlo check.

Reading of the paper's notation (Liu et al. 2022 §6, "Setup"):
- σ² is the per-point data variance and τ² the variance of the silo centers around θ.
- σ_DP² is the variance of the Gaussian noise ξ_k added to the *sum* Σ_i x_{k,i} (sensitivity c),
  not to the mean: the released local mean is ŵ_k = (ξ_k + Σ_i x_{k,i}) / n, so its privacy noise
  has variance σ_DP²/n². Hence the local variance σ_loc² = σ²/n + σ_DP²/n² (eq. 5), and
  λ* = (σ² + σ_DP²/n) / (nτ²) = σ_loc²/τ² (Thm 6.3, eq. 7).
- The clipping bound c is assumed large enough that no point is clipped (the paper's "w.h.p."
  assumption), so the simulator does not clip.
- The error is E[(w_k − ŵ_k(λ))²], the squared distance to the true center. The paper calls it the
  generalization error; the error on a fresh point would add the constant σ², which moves no
  optimum. Lemma 6.7's expression equals this error averaged over the data, w_k and the noise,
  which is what the simulator measures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from research.mean_estimation_data import draw_centers_and_points

# Points generated per simulation chunk: bounds memory (8 bytes each) whatever trials × K × n is.
_CHUNK_POINTS = 2_000_000


def gaussian_mechanism_noise_std(*, epsilon: float, delta: float, clip: float) -> float:
    """σ_DP = c·√(2 ln(1.25/δ))/ε, the noise scale Liu et al. 2022 §6 uses for (ε, δ) sample-level DP.

    This classic calibration (Dwork & Roth 2014, Thm A.1) is only proven for ε < 1, so larger ε is
    refused rather than silently under-noised.
    """
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"epsilon must be in (0, 1) for the classic Gaussian mechanism. Found {epsilon}.")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1). Found {delta}.")
    if not (math.isfinite(clip) and clip > 0.0):
        raise ValueError(f"clip must be a finite number > 0. Found {clip}.")
    return clip * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def mr_mtl_weight(*, lam: float, n_silos: int) -> float:
    """α = (K + λ)/((1 + λ)K) of Lemma 6.1 (Liu et al. 2022 §6), the weight on the silo's own estimate.

    λ = 0 gives exactly 1 (local training); λ = ∞ gives the limit 1/K (FedAvg's plain average).
    """
    if n_silos < 2:
        raise ValueError(f"n_silos must be at least 2 for MR-MTL. Found {n_silos}.")
    if not lam >= 0.0:
        raise ValueError(f"lam must be >= 0 (math.inf allowed). Found {lam}.")
    if math.isinf(lam):
        return 1.0 / n_silos
    return (n_silos + lam) / ((1.0 + lam) * n_silos)


def release_local_means(
    points: np.ndarray, *, dp_noise_variance: float, rng: np.random.Generator
) -> np.ndarray:
    """Each silo's released estimate ŵ_k = (ξ_k + Σ_i x_{k,i})/n with ξ_k ~ N(0, σ_DP²)
    (Liu et al. 2022 §6, the argmin of F̃_k). `points` has silos and points on its last two axes."""
    if not (math.isfinite(dp_noise_variance) and dp_noise_variance >= 0.0):
        raise ValueError(f"dp_noise_variance must be a finite number >= 0. Found {dp_noise_variance}.")
    n = points.shape[-1]
    noise = math.sqrt(dp_noise_variance) * rng.standard_normal(points.shape[:-1])
    released: np.ndarray = (noise + points.sum(axis=-1)) / n
    return released


def mr_mtl_estimates(released: np.ndarray, *, lam: float) -> np.ndarray:
    """ŵ_k(λ) = α·ŵ_k + (1 − α)·ŵ_{\\k} for every silo k (Lemma 6.1, eq. 4), silos on the last axis.

    ŵ_{\\k} is the average of the *other* silos' released estimates, so the server only ever
    post-processes released values (no extra privacy cost, Liu et al. 2022 §5).
    """
    n_silos = released.shape[-1]
    alpha = mr_mtl_weight(lam=lam, n_silos=n_silos)
    external = (released.sum(axis=-1, keepdims=True) - released) / (n_silos - 1)
    estimates: np.ndarray = alpha * released + (1.0 - alpha) * external
    return estimates


@dataclass(frozen=True)
class MeanEstimationSetting:
    """The parameters of Liu et al. 2022 §6: K silos, n points each, σ², τ², σ_DP² (variances)."""

    n_silos: int
    n: int
    data_variance: float
    heterogeneity: float
    dp_noise_variance: float

    def __post_init__(self) -> None:
        if self.n_silos < 2:
            raise ValueError(f"n_silos must be at least 2. Found {self.n_silos}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1. Found {self.n}.")
        for name in ("data_variance", "heterogeneity", "dp_noise_variance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0. Found {value}.")

    @property
    def local_variance(self) -> float:
        """σ_loc² = σ²/n + σ_DP²/n² (eq. 5): the variance of ŵ_k around w_k."""
        return self.data_variance / self.n + self.dp_noise_variance / self.n**2

    @property
    def optimal_lambda(self) -> float:
        """λ* = (σ² + σ_DP²/n)/(nτ²) (Thm 6.3, eq. 7); ∞ when τ² = 0 (identical silos: FedAvg)."""
        if self.heterogeneity == 0.0:
            return math.inf
        return (self.data_variance + self.dp_noise_variance / self.n) / (self.n * self.heterogeneity)

    def mse(self, lam: float) -> float:
        """E(λ) = (1 − 1/K)(σ_loc² + λ²τ²)/(λ + 1)² + σ_loc²/K (Lemma 6.7); at λ = ∞ its limit
        (1 − 1/K)τ² + σ_loc²/K, the FedAvg error."""
        if not lam >= 0.0:
            raise ValueError(f"lam must be >= 0 (math.inf allowed). Found {lam}.")
        k, s2, t2 = self.n_silos, self.local_variance, self.heterogeneity
        if math.isinf(lam):
            return (1.0 - 1.0 / k) * t2 + s2 / k
        return (1.0 - 1.0 / k) * (s2 + lam**2 * t2) / (lam + 1.0) ** 2 + s2 / k

    @property
    def optimal_mse(self) -> float:
        """E* = σ_loc²(σ_loc² + Kτ²)/(K(σ_loc² + τ²)) (Cor. 6.4, eq. 8)."""
        k, s2, t2 = self.n_silos, self.local_variance, self.heterogeneity
        return s2 * (s2 + k * t2) / (k * (s2 + t2))

    @property
    def local_gap(self) -> float:
        """Δ_loc = E_loc − E* = (1 − 1/K)σ_loc⁴/(σ_loc² + τ²) (Prop. 6.5, eq. 9), E_loc = σ_loc²."""
        s2, t2 = self.local_variance, self.heterogeneity
        return (1.0 - 1.0 / self.n_silos) * s2**2 / (s2 + t2)

    @property
    def fedavg_gap(self) -> float:
        """Δ_fed = E_fed − E* = (1 − 1/K)τ⁴/(σ_loc² + τ²) (Prop. 6.6, eq. 10)."""
        s2, t2 = self.local_variance, self.heterogeneity
        return (1.0 - 1.0 / self.n_silos) * t2**2 / (s2 + t2)

    def privacy_cost(self, lam: float) -> float:
        """Δ_DP(λ) = (1 − 1/K)σ_DP²/((λ + 1)²n²) + σ_DP²/(Kn²) (Thm 6.8)."""
        if not lam >= 0.0:
            raise ValueError(f"lam must be >= 0 (math.inf allowed). Found {lam}.")
        k, dp = self.n_silos, self.dp_noise_variance / self.n**2
        shrink = 0.0 if math.isinf(lam) else 1.0 / (lam + 1.0) ** 2
        return (1.0 - 1.0 / k) * shrink * dp + dp / k


@dataclass(frozen=True)
class SimulatedMSE:
    """Monte Carlo estimate of E(λ) for each λ, with its standard error.

    mse[j] averages (w_k − ŵ_k(λ_j))² over silos and trials; stderr[j] is the standard deviation
    of the per-trial silo average divided by √trials (trials are i.i.d.; silos within a trial are
    not, because they share the external average).
    """

    lambdas: np.ndarray
    mse: np.ndarray
    stderr: np.ndarray
    trials: int


def simulate_mse(
    setting: MeanEstimationSetting,
    *,
    lambdas: Sequence[float],
    trials: int,
    seed: int,
    meta_center: float = 0.0,
) -> SimulatedMSE:
    """Draw the §6 model `trials` times and measure the error of MR-MTL(λ) for every λ.

    All λ are evaluated on the same draws (common random numbers), so differences across the grid
    (and its argmin) are far less noisy than with independent draws per λ.
    """
    if trials < 2:
        raise ValueError(f"trials must be at least 2 (a standard error needs two). Found {trials}.")
    grid = np.asarray(lambdas, dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0:
        raise ValueError(f"lambdas must be a non-empty 1-D sequence. Found shape {grid.shape}.")
    lams = [float(lam) for lam in grid]
    for lam in lams:
        mr_mtl_weight(lam=lam, n_silos=setting.n_silos)  # validate the whole grid before drawing
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_POINTS // (setting.n_silos * setting.n))
    total = np.zeros(grid.size)
    total_sq = np.zeros(grid.size)
    done = 0
    while done < trials:
        batch = min(chunk, trials - done)
        centers, points = draw_centers_and_points(
            rng,
            n_silos=setting.n_silos,
            n_per_silo=setting.n,
            data_variance=setting.data_variance,
            heterogeneity=setting.heterogeneity,
            meta_center=meta_center,
            batch=batch,
        )
        released = release_local_means(points, dp_noise_variance=setting.dp_noise_variance, rng=rng)
        # (λ, batch): each trial's silo-averaged squared error, one row per λ on the same draws.
        per_trial = np.stack([np.mean((mr_mtl_estimates(released, lam=lam) - centers) ** 2, axis=-1) for lam in lams])
        total += per_trial.sum(axis=1)
        total_sq += (per_trial**2).sum(axis=1)
        done += batch
    mean = total / trials
    variance = np.maximum(total_sq / trials - mean**2, 0.0) * trials / (trials - 1)
    return SimulatedMSE(lambdas=grid, mse=mean, stderr=np.sqrt(variance / trials), trials=trials)
