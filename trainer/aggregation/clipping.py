"""Update clipping, and the clip norm adapted to a quantile of the update norms by a noisy query
(FedHDP Alg. 2, last line; Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially private
learning with adaptive clipping", Alg. 1)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dpledger.trainer.aggregation._checks import check_positive, check_updates
from dpledger.trainer.silo.dpsgd.clip import clip_rows
from dpledger.wire.mechanisms import Gaussian


def clip_updates(updates: torch.Tensor, *, clip_norm: float) -> torch.Tensor:
    """Each row scaled to norm ≤ C: u·C/max(‖u‖, C) (FedHDP Alg. 2 Clip; Hu et al. 2023 Alg. 1 line 8).

    Exact for ‖u‖ ≤ C (factor 1) and safe at u = 0, with no ε added to the norm that could let a
    clipped row exceed C by rounding."""
    check_updates(updates)
    c = check_positive(clip_norm, name="clip_norm")
    return clip_rows(updates, max_grad_norm=c)


class QuantileClipUpdate(NamedTuple):
    """The next clip norm, the mechanism that the quantile query ran (to be charged to every silo
    whose indicator it read), and the noisy unclipped fraction b̃ it used."""

    clip_norm: float
    mechanism: Gaussian
    noisy_fraction: float


def noisy_quantile_clip_update(
    update_norms: torch.Tensor,
    *,
    clip_norm: float,
    target_quantile: float,
    learning_rate: float,
    noise_multiplier: float,
    generator: torch.Generator,
) -> QuantileClipUpdate:
    """S ← S·exp(−η_b(b̃ − κ)), b̃ = (Σ_i 1[‖Δ_i‖ ≤ S] + N(0, σ_b²)) / N (FedHDP Alg. 2; Andrew
    et al. 2021 Alg. 1, geometric update).

    With b̃ the exact fraction of unclipped updates, the clip shrinks while more than a κ fraction
    fit under it and grows while fewer do, so it settles at the κ-quantile of the norms.

    Privacy: the indicators are a count query of sensitivity 1 (one silo changes its own bit by at
    most 1; Andrew et al. 2021), released with Gaussian noise of standard deviation σ_b, so the
    query is `{"type": "gaussian", "noise_multiplier": σ_b}`, charged to each silo whose indicator
    it read, in addition to the update itself. σ_b must be > 0: a noiseless count is not DP and
    could not be charged.
    """
    if not isinstance(update_norms, torch.Tensor) or update_norms.dim() != 1 or update_norms.numel() < 1:
        raise ValueError(
            f"update_norms must be a non-empty 1-D tensor. Found {getattr(update_norms, 'shape', type(update_norms))}."
        )
    if not bool(torch.isfinite(update_norms).all()) or bool((update_norms < 0).any()):
        raise ValueError("update_norms must be finite and >= 0 (L2 norms).")
    s = check_positive(clip_norm, name="clip_norm")
    if isinstance(target_quantile, bool) or not isinstance(target_quantile, int | float) or not 0.0 < target_quantile < 1.0:
        raise ValueError(f"target_quantile must be in (0, 1). Found {target_quantile!r}.")
    eta = check_positive(learning_rate, name="learning_rate")
    sigma_b = check_positive(noise_multiplier, name="noise_multiplier")
    n = update_norms.numel()
    unclipped = float((update_norms <= s).sum())
    noise = float(torch.randn((), generator=generator, dtype=torch.float64)) * sigma_b
    noisy_fraction = (unclipped + noise) / n
    new_clip = s * math.exp(-eta * (noisy_fraction - float(target_quantile)))
    return QuantileClipUpdate(
        clip_norm=new_clip,
        mechanism=Gaussian(noise_multiplier=sigma_b),
        noisy_fraction=noisy_fraction,
    )
