"""FedHDP federated point estimation (FedHDP §3.1): the generative model, the server's two-step
estimator with ratio r, a Monte Carlo simulator of its error, and the closed forms (Lemma 1, eq. (13)).

Reading of the paper's model (§3.1, eqs. (5)–(8), Alg. 1 of its Appendix B):
- φ is the global parameter; client j's own parameter is φ_j = φ + p_j, p_j ~ N(0, τ²) (eq. (5)).
- Client j observes n_s points x_{j,i} = φ_j + v_{j,i}, v_{j,i} ~ N(0, n_s α²) (eq. (6)), so its
  local estimate φ̂_j, their mean, has φ̂_j − φ ~ N(0, α² + τ²).
- A private client sends ψ_j = φ̂_j + l_j with l_j ~ N(0, (1 − ρ_np)Nγ²); a non-private one sends
  ψ_j = φ̂_j (eq. (8) and §3.1.2: γ_j² = 0 or (1 − ρ_np)Nγ²). The noise is drawn per client, which
  is how Alg. 1 adds it, and gives the private group's mean θ_p the variance
  (α²+τ²)/((1−ρ_np)N) + γ² that §3.1.2 states.
- The server estimates φ by θ = (Σ_np ψ_i + r Σ_p ψ_i)/(N_np + r N_p) (Alg. 1, server line; the
  two group means of eq. (12) weighted N_np : rN_p). Its error is the mean squared error
  E(θ − φ)² = σ_s², which the simulator measures and eq. (13) gives at r = r*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpledger.trainer.aggregation.fedhdp import optimal_ratio

# Trials simulated per chunk: bounds memory (N float64 numbers per trial) whatever n_trials is.
_CHUNK_TRIALS = 200_000


@dataclass(frozen=True)
class PointEstimationSetup:
    """N clients of which `n_nonprivate` = ρ_np·N opt out of privacy (FedHDP §3.1.1, Table 1)."""

    n_clients: int
    n_nonprivate: int
    alpha2: float
    tau2: float
    gamma2: float

    def __post_init__(self) -> None:
        if isinstance(self.n_clients, bool) or not isinstance(self.n_clients, int) or self.n_clients < 1:
            raise ValueError(f"n_clients must be an integer >= 1. Found {self.n_clients!r}.")
        if (
            isinstance(self.n_nonprivate, bool)
            or not isinstance(self.n_nonprivate, int)
            or not 0 <= self.n_nonprivate <= self.n_clients
        ):
            raise ValueError(f"n_nonprivate must be an integer in [0, n_clients={self.n_clients}]. Found {self.n_nonprivate!r}.")
        for name in ("alpha2", "tau2", "gamma2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0. Found {value}.")
        if self.alpha2 + self.tau2 == 0.0:
            raise ValueError("alpha2 + tau2 must be > 0: with no client variance there is nothing to estimate.")

    @property
    def rho_np(self) -> float:
        return self.n_nonprivate / self.n_clients

    @property
    def n_private(self) -> int:
        return self.n_clients - self.n_nonprivate

    @property
    def client_variance(self) -> float:
        """α² + τ²: the variance of a client's local estimate φ̂_j around φ."""
        return self.alpha2 + self.tau2

    @property
    def private_noise_variance(self) -> float:
        """(1 − ρ_np)Nγ² = N_p γ²: the DP noise variance of one private client's update (§3.1.2)."""
        return self.n_private * self.gamma2

    def lemma1_ratio(self) -> float:
        """r* = (α² + τ²)/(α² + τ² + (1 − ρ_np)Nγ²) (FedHDP Lemma 1)."""
        return optimal_ratio(client_variance=self.client_variance, noise_variance=self.private_noise_variance)

    def server_variance(self, *, ratio: float) -> float:
        """σ_s²(r) = (N_np σ_c² + r² N_p (σ_c² + N_pγ²)) / (N_np + r N_p)², the error of θ for any r:
        θ is a weighted sum of independent unbiased ψ_i, so its variance is Σ w_i² Var ψ_i. Its
        minimum over r is at Lemma 1's r*, with the value of eq. (13)."""
        if not (math.isfinite(ratio) and ratio >= 0.0):
            raise ValueError(f"ratio must be a finite number >= 0. Found {ratio}.")
        n_np, n_p, sc = self.n_nonprivate, self.n_private, self.client_variance
        denominator = n_np + ratio * n_p
        if denominator == 0.0:
            raise ValueError("ratio must be > 0 when every client is private: all weights would be 0.")
        return (n_np * sc + ratio**2 * n_p * (sc + self.private_noise_variance)) / denominator**2

    def optimal_server_variance(self) -> float:
        """σ²_s,opt = (1/N)·(α²+τ²)(α²+τ²+(1−ρ_np)Nγ²)/(α²+τ²+ρ_np(1−ρ_np)Nγ²) (FedHDP eq. (13))."""
        sc, rho, n = self.client_variance, self.rho_np, self.n_clients
        return (sc * (sc + (1.0 - rho) * n * self.gamma2)) / (n * (sc + rho * (1.0 - rho) * n * self.gamma2))


def draw_updates(
    setup: PointEstimationSetup,
    *,
    n_trials: int,
    rng: np.random.Generator,
    phi: float = 0.0,
    samples_per_client: int | None = None,
) -> np.ndarray:
    """[n_trials, N] updates ψ_j of independent draws of the model; clients 0..N_np−1 are the
    non-private ones.

    With `samples_per_client` = n_s the n_s observations of eq. (6) are drawn and averaged; without
    it φ̂_j is drawn directly as φ_j + N(0, α²), which is the same distribution (the mean of n_s
    independent N(0, n_s α²) draws is N(0, α²)) at 1/n_s of the cost.
    """
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ValueError(f"n_trials must be an integer >= 1. Found {n_trials!r}.")
    if not math.isfinite(phi):
        raise ValueError(f"phi must be finite. Found {phi}.")
    n = setup.n_clients
    client_params = phi + math.sqrt(setup.tau2) * rng.standard_normal((n_trials, n))
    if samples_per_client is None:
        local = client_params + math.sqrt(setup.alpha2) * rng.standard_normal((n_trials, n))
    else:
        if isinstance(samples_per_client, bool) or not isinstance(samples_per_client, int) or samples_per_client < 1:
            raise ValueError(f"samples_per_client must be an integer >= 1. Found {samples_per_client!r}.")
        observation_std = math.sqrt(samples_per_client * setup.alpha2)
        observations = client_params[..., None] + observation_std * rng.standard_normal((n_trials, n, samples_per_client))
        local = observations.mean(axis=-1)
    noise = np.zeros((n_trials, n))
    noise[:, setup.n_nonprivate :] = math.sqrt(setup.private_noise_variance) * rng.standard_normal((n_trials, setup.n_private))
    return local + noise


def two_step_estimate(updates: np.ndarray, *, n_nonprivate: int, ratio: float) -> np.ndarray:
    """θ = (N_np θ_np + r N_p θ_p)/(N_np + r N_p) per row of `updates` [T, N] (FedHDP eq. (12)
    and Alg. 1's server line), the first `n_nonprivate` columns being the non-private clients."""
    if updates.ndim != 2:
        raise ValueError(f"updates must be [n_trials, N]. Found shape {updates.shape}.")
    n = updates.shape[1]
    if not 0 <= n_nonprivate <= n:
        raise ValueError(f"n_nonprivate must be in [0, {n}]. Found {n_nonprivate}.")
    if not (math.isfinite(ratio) and ratio >= 0.0):
        raise ValueError(f"ratio must be a finite number >= 0. Found {ratio}.")
    denominator = n_nonprivate + ratio * (n - n_nonprivate)
    if denominator == 0.0:
        raise ValueError("ratio must be > 0 when every client is private: all weights would be 0.")
    mean: np.ndarray = (updates[:, :n_nonprivate].sum(axis=1) + ratio * updates[:, n_nonprivate:].sum(axis=1)) / denominator
    return mean


@dataclass(frozen=True)
class ServerMseSimulation:
    """Monte Carlo E(θ − φ)² and its standard error at each ratio. The same draws serve every
    ratio (common random numbers), so differences between ratios are far more precise than the
    standard errors suggest, and the empirical argmin is stable."""

    ratios: np.ndarray
    mse: np.ndarray
    stderr: np.ndarray


def simulate_server_mse(
    setup: PointEstimationSetup, *, ratios: Sequence[float], n_trials: int, seed: int, phi: float = 0.0
) -> ServerMseSimulation:
    """Simulate the model `n_trials` times and measure the server's error at each ratio."""
    grid = np.asarray(ratios, dtype=np.float64)
    if grid.ndim != 1 or grid.size < 1:
        raise ValueError(f"ratios must be a non-empty 1-D sequence. Found shape {grid.shape}.")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 2:
        raise ValueError(f"n_trials must be an integer >= 2 (a standard error needs two). Found {n_trials!r}.")
    if bool((grid < 0).any()) or not bool(np.isfinite(grid).all()):
        raise ValueError(f"ratios must be finite and >= 0. Found {grid.tolist()}.")
    n_np, n_p = setup.n_nonprivate, setup.n_private
    if n_np == 0 and bool((grid == 0).any()):
        raise ValueError("ratio must be > 0 when every client is private: all weights would be 0.")
    rng = np.random.default_rng(seed)
    sums = np.zeros(grid.size)
    sums_sq = np.zeros(grid.size)
    remaining = n_trials
    while remaining > 0:
        chunk = min(remaining, _CHUNK_TRIALS)
        updates = draw_updates(setup, n_trials=chunk, rng=rng, phi=phi)
        # two_step_estimate for every ratio at once: the group sums do not depend on r.
        nonprivate_sum = updates[:, :n_np].sum(axis=1) - n_np * phi
        private_sum = updates[:, n_np:].sum(axis=1) - n_p * phi
        for i, ratio in enumerate(grid.tolist()):
            squared_error = ((nonprivate_sum + ratio * private_sum) / (n_np + ratio * n_p)) ** 2
            sums[i] += squared_error.sum()
            sums_sq[i] += (squared_error**2).sum()
        remaining -= chunk
    mse = sums / n_trials
    variance = np.maximum(sums_sq / n_trials - mse**2, 0.0) * n_trials / (n_trials - 1)
    return ServerMseSimulation(ratios=grid, mse=mse, stderr=np.sqrt(variance / n_trials))
