"""Gaussian noise from an explicit generator: the one noise primitive of the engine and the batched
simulator, so that a run is reproducible from its seeds and never draws from torch's global stream."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def same_device(a: torch.device, b: torch.device) -> bool:
    # torch.device("cuda") and torch.device("cuda:0") name the same device when index is unset.
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def gaussian_noise(
    shape: Sequence[int] | torch.Size, *, std: float, generator: torch.Generator, device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """N(0, std²) on every coordinate, one draw from `generator`, which must live on `device`."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std must be finite and >= 0. Found {std}.")
    if not same_device(generator.device, device):
        raise ValueError(f"generator is on {generator.device} but the noise is wanted on {device}.")
    return torch.empty(tuple(shape), dtype=dtype, device=device).normal_(0.0, std, generator=generator)


def add_gaussian_noise(grads: Sequence[Tensor], *, std: float, generator: torch.Generator) -> list[Tensor]:
    """grads + N(0, std²) on every coordinate, drawn from `generator` in the order given."""
    # One stream, drawn serially (on CPU, the largest cost of the step left over the non-private
    # one). Splitting it over child generators seeded from this one would parallelize, but torch
    # seeds a CPU generator from 32 bits only: over ~10^5 child seeds two chunks of different
    # steps would likely get the same seed, and so the same noise.
    return [gaussian_noise(g.shape, std=std, generator=generator, device=g.device, dtype=g.dtype).add_(g) for g in grads]
