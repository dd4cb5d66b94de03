"""PMTL's global learner (Hu et al. 2023 Alg. 1, line 8): clip each selected task's model update,
average, add Gaussian noise; and the mechanism one round of it runs.

Line 8 reads w̄ ← w̄ + (1/|S_t|)·Σ_{k∈S_t} g_k·min(1, γ/‖g_k‖) + N(0, σ²I) with |S_t| = q fixed.
Here the tasks (silos) are Poisson-sampled at rate p, as the declared mechanism says (the house rule:
the mechanism a worker declares is the sampler it runs), so the average divides by the *expected*
count pK rather than the realised |S_t|: then one task moves the sum by at most γ whatever the
others do, and noise of standard deviation z·γ on the sum is exactly the sampled Gaussian mechanism
with noise multiplier z (Hu et al. 2023 Thm 1 and eq. (17)–(19): σ on the mean = zγ/(pK)).
"""

from __future__ import annotations

from typing import Literal, TypedDict

import torch

from dpledger.trainer.aggregation._checks import (
    check_mask,
    check_non_negative,
    check_positive,
    check_probability,
    check_updates,
)
from dpledger.trainer.aggregation.clipping import clip_updates


class GaussianMechanism(TypedDict):
    """A Gaussian mechanism in the ledger's wire format, as a plain dict (the research copies are dict-based)."""

    type: Literal["gaussian"]
    noise_multiplier: float


class PoissonSampledGaussian(TypedDict):
    type: Literal["poisson_sampled"]
    sampling_rate: float
    event: GaussianMechanism


def sample_tasks(n_tasks: int, *, sampling_rate: float, generator: torch.Generator) -> torch.Tensor:
    """bool [K]: each task selected independently with probability p (Poisson sampling of S_t)."""
    if isinstance(n_tasks, bool) or not isinstance(n_tasks, int) or n_tasks < 1:
        raise ValueError(f"n_tasks must be an integer >= 1. Found {n_tasks!r}.")
    p = check_probability(sampling_rate, name="sampling_rate")
    return torch.rand(n_tasks, generator=generator, dtype=torch.float64) < p


def pmtl_server_step(
    global_params: torch.Tensor,
    task_updates: torch.Tensor,
    selected: torch.Tensor,
    *,
    clip_norm: float,
    noise_multiplier: float,
    sampling_rate: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """w̄ + (Σ_{k∈S} clip_γ(g_k) + N(0, z²γ²I)) / (pK): the next mean model [P] (Hu et al. 2023 Alg. 1
    line 8, with the expected-count denominator explained in the module docstring).

    `task_updates` [K, P] holds g_k = w_k − w̄ for every task; only the rows with `selected[k]` are
    read. The noise comes from `generator` and is drawn even when no task was selected, so the
    output's distribution is the declared mechanism's in every case. z = 0 is allowed (non-private
    MR-MTL, Hu et al. 2023 §4.3's σ = 0 case, Cor. 4) but then there is no mechanism to declare.
    """
    check_updates(task_updates, name="task_updates")
    k, p_dim = task_updates.shape
    if global_params.shape != (p_dim,) or not global_params.is_floating_point():
        raise ValueError(f"global_params must be a floating tensor of shape ({p_dim},). Found {tuple(global_params.shape)}.")
    check_mask(selected, n=k, name="selected")
    gamma = check_positive(clip_norm, name="clip_norm")
    z = check_non_negative(noise_multiplier, name="noise_multiplier")
    p = check_probability(sampling_rate, name="sampling_rate")
    clipped = clip_updates(task_updates, clip_norm=gamma)
    total = torch.where(
        selected.to(clipped.device).unsqueeze(1), clipped, torch.zeros((), dtype=clipped.dtype, device=clipped.device)
    ).sum(0)
    noise = torch.randn(p_dim, generator=generator, dtype=clipped.dtype, device=generator.device).to(clipped.device)
    return global_params + (total + noise * (z * gamma)) / (p * k)


def pmtl_round_mechanism(*, sampling_rate: float, noise_multiplier: float) -> PoissonSampledGaussian:
    """One round of `pmtl_server_step` for a silo: the Poisson-sampled Gaussian over silos
    (Hu et al. 2023 Thm 1), `{"type": "poisson_sampled", "sampling_rate": p, "event": {"type": "gaussian",
    "noise_multiplier": z}}`.

    This is Hu et al. 2023's guarantee: client-level DP under adding or removing one silo (sensitivity γ),
    towards everyone but the trusted global learner (Hu et al. 2023 §4.1), with the selection S_t kept
    secret by that learner: amplification by sampling needs the sample to be unknown to whoever the
    guarantee is against. Where the selection is public, or for record-level neighbours (one record
    may move the silo's clipped update anywhere in the γ-ball, by up to 2γ), charge
    `pmtl_record_level_mechanism` instead.
    """
    p = check_probability(sampling_rate, name="sampling_rate")
    z = check_positive(noise_multiplier, name="noise_multiplier")
    return PoissonSampledGaussian(
        type="poisson_sampled", sampling_rate=p, event=GaussianMechanism(type="gaussian", noise_multiplier=z)
    )


def pmtl_record_level_mechanism(*, noise_multiplier: float) -> GaussianMechanism:
    """The same round for a sampled silo, without amplification and with record-level sensitivity:
    a change of one record moves the silo's clipped update by at most 2γ, and the noise on the sum
    has standard deviation zγ, so it is the Gaussian mechanism with noise multiplier z/2. Valid
    whether or not the selection is secret (a silo that was not selected touched no data and
    declares nothing)."""
    z = check_positive(noise_multiplier, name="noise_multiplier")
    return GaussianMechanism(type="gaussian", noise_multiplier=z / 2.0)
