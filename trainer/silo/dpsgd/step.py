"""One DP-SGD step (Abadi et al. 2016) as small named phases.

Public API:

- `clip_factors` (from `trainer.silo.dpsgd.clip`): min(1, C/||g_i||), 1 for a zero gradient.
- `clipped_grad_sum(model, loss_fn, x, y, *, max_grad_norm) -> ClippedGradSum`: Σ_i c_i·g_i for
  every trainable parameter, and the per-sample norms it clipped, without per-sample gradients
  wherever a ghost rule exists (see `trainer.silo.dpsgd.norms`).
- `add_gaussian_noise` (from `trainer.silo.dpsgd.noise`): grads + N(0, std²) per coordinate.
- `dp_sgd_step(model, loss_fn, x, y, *, max_grad_norm, noise_multiplier, expected_batch_size,
  generator, optimizer) -> StepStats`: the phases above, then division by the expected batch size
  and `optimizer.step()`.

`loss_fn(output, y)` returns per-example losses (reduction="none"). The step runs on the device of
the model's parameters; `generator` must live there too, so the noise never crosses devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import torch
from torch import Tensor, nn

from dpledger.trainer.silo.dpsgd.capture import LossFn, trainable_parameters
from dpledger.trainer.silo.dpsgd.clip import clip_factors
from dpledger.trainer.silo.dpsgd.noise import add_gaussian_noise
from dpledger.trainer.silo.dpsgd.norms import layer_grads, norms_from_layers

__all__ = [
    "ClippedGradSum", "PrivateGradient", "StepStats", "add_gaussian_noise", "clip_factors", "clipped_grad_sum",
    "dp_sgd_step", "private_gradient",
]


@dataclass(frozen=True)
class ClippedGradSum:
    """Σ_i c_i·g_i, aligned with `params`, and the pre-clip norms ||g_i|| of the batch."""

    params: list[nn.Parameter]
    grads: list[Tensor]
    norms: Tensor


@dataclass(frozen=True)
class StepStats:
    """What one step did.

    Only `noisy_update_norm` is a private release (post-processing of the noisy sum) and may leave
    the silo; `batch_size` and `clipped_fraction` are computed from raw data and are local
    diagnostics only.
    """

    batch_size: int
    clipped_fraction: float
    noisy_update_norm: float


def _require_finite_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0. Found {value}.")


def _model_device(params: Sequence[nn.Parameter]) -> torch.device:
    if not params:
        raise ValueError("The model has no trainable parameters.")
    return params[0].device


def clipped_grad_sum(
    model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, *, max_grad_norm: float
) -> ClippedGradSum:
    """Σ_i min(1, C/||g_i||)·g_i over the batch, for each trainable parameter (zeros if empty)."""
    _require_finite_positive("max_grad_norm", max_grad_norm)
    params = trainable_parameters(model)
    device = _model_device(params)
    x, y = x.to(device), y.to(device)
    layers = layer_grads(model, loss_fn, x, y)
    norms = norms_from_layers(layers, batch_size=x.shape[0], like=params[0])
    factors = clip_factors(norms, max_grad_norm=max_grad_norm)
    summed: dict[int, Tensor] = {}
    for layer in layers:
        for param, value in layer.weighted_sum(factors):
            summed[id(param)] = value
    # A parameter whose layer did not run (or an empty batch) has a zero clipped sum.
    grads = [summed[id(p)] if id(p) in summed else torch.zeros_like(p) for p in params]
    return ClippedGradSum(params=params, grads=grads, norms=norms)


@dataclass(frozen=True)
class PrivateGradient:
    """(Σ_i c_i·g_i + N(0, σ²C²)) / B for each trainable parameter, aligned with `params`, and the
    pre-clip norms of the batch (local diagnostics only)."""

    params: list[nn.Parameter]
    grads: list[Tensor]
    norms: Tensor


def private_gradient(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: torch.Generator,
) -> PrivateGradient:
    """Clip, sum, add N(0, σ²C²) in one draw from `generator`, divide by the expected batch size.

    `x` is a Poisson-sampled batch and may be empty (the gradient is then noise only). Dividing by
    the expected batch size q·n rather than the realized one keeps the sensitivity of the average
    at C/(q·n) whatever batch was drawn; the realized size depends on the data and is not private.
    """
    _require_finite_positive("expected_batch_size", expected_batch_size)
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0. Found {noise_multiplier}.")
    clipped = clipped_grad_sum(model, loss_fn, x, y, max_grad_norm=max_grad_norm)
    noisy = add_gaussian_noise(clipped.grads, std=noise_multiplier * max_grad_norm, generator=generator)
    return PrivateGradient(params=clipped.params, grads=[g.div_(expected_batch_size) for g in noisy], norms=clipped.norms)


class NoiseArgs(TypedDict):
    """private_gradient's noise arguments, which dp_sgd_step passes through unchanged."""

    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: float
    generator: torch.Generator


def dp_sgd_step(
    model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, *, optimizer: torch.optim.Optimizer,
    **noise: Unpack[NoiseArgs],
) -> StepStats:
    """`private_gradient`, written into every trainable parameter's `.grad`, then `optimizer.step()`."""
    private = private_gradient(model, loss_fn, x, y, **noise)
    for param, value in zip(private.params, private.grads, strict=True):
        param.grad = value
    update_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in private.grads]))
    optimizer.step()
    batch_size = int(private.norms.shape[0])
    clipped_count = (private.norms > noise["max_grad_norm"]).sum()
    # One host transfer for both numbers: each .item() would be its own device sync on CUDA.
    update_norm_value, clipped_count_value = torch.stack([update_norm.double(), clipped_count.double()]).tolist()
    return StepStats(
        batch_size=batch_size,
        clipped_fraction=clipped_count_value / batch_size if batch_size else 0.0,
        noisy_update_norm=update_norm_value,
    )
