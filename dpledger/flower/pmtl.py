"""PMTL's server step over Flower and what one round of it costs a silo (Hu et al., "Private
Multi-Task Learning", Alg. 1 line 8), with every asked silo taking part (no client sampling).

w̄ ← w̄ + (Σ_{k trained} clip_γ(w_k − w̄) + N(0, z²γ²I)) / K, K the number of silos asked: a fixed
count, so one silo's update moves the sum by at most γ whatever the others answer. For one record
of a silo (the ledger's sample-level relation) the clipped update can move anywhere in the γ-ball,
by up to 2γ: the round is the Gaussian mechanism with multiplier z/2. The in-process research copy
(`research/pmtl.py`) adds Poisson sampling of silos, whose amplification the ledger cannot check.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpledger.trainer.aggregation.clipping import clip_updates


def record_level_mechanism(*, server_noise: float) -> dict[str, Any]:
    """What each silo that trains in a PMTL round is charged: `{"type": "gaussian", "noise_multiplier": z/2}`."""
    if not (math.isfinite(server_noise) and server_noise > 0):
        raise ValueError(f"server_noise must be finite and > 0. Found {server_noise}.")
    return {"type": "gaussian", "noise_multiplier": server_noise / 2.0}


def server_step(
    mean: torch.Tensor, models: torch.Tensor, trained: torch.Tensor, *, update_clip: float, server_noise: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The next mean [P] from the asked silos' models [K, P] (rows where `trained` is false are not
    read). The noise is drawn whatever answered, so the output is the charged mechanism's in every case."""
    if models.ndim != 2 or models.shape[1:] != mean.shape or trained.shape != (models.shape[0],) or trained.dtype != torch.bool:
        raise ValueError(f"models must be [K, {mean.shape[0]}] with a bool mask [K]. Found {tuple(models.shape)}, "
                         f"{tuple(trained.shape)} {trained.dtype}.")
    if not (math.isfinite(server_noise) and server_noise > 0):
        raise ValueError(f"server_noise must be finite and > 0. Found {server_noise}.")
    updates = torch.where(trained.unsqueeze(1), models - mean, torch.zeros((), dtype=mean.dtype))
    total = clip_updates(updates, clip_norm=update_clip).sum(0)
    noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
    return mean + (total + noise * (server_noise * update_clip)) / models.shape[0]
