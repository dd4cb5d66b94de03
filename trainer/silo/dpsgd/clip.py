"""The clip factor: the one place in the repository where a norm is clipped to C.

Per-sample gradients (the DP-SGD engine, the batched K-silo simulator), per-silo updates
(aggregation) and per-record cluster losses (IFCA's private selection) all scale a vector g by
min(1, C/‖g‖) through `clip_factors`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def clip_factors(norms: Tensor, *, max_grad_norm: float) -> Tensor:
    """min(1, C/‖g_i‖) for each norm.

    Written as C / max(‖g_i‖, C): identical to the min, and a zero norm gives C/C = 1 instead of
    C/0, so no ε is added to the denominator (which could let a clipped vector exceed C by
    rounding, as `C/(‖g‖ + 1e-6)` clamped at 1 does in Opacus) and no NaN can appear.
    """
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be finite and > 0. Found {max_grad_norm}.")
    return max_grad_norm / norms.clamp(min=max_grad_norm)


def clip_rows(rows: Tensor, *, max_grad_norm: float) -> Tensor:
    """Each row of a [n, d] tensor scaled to norm ≤ C."""
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    return rows * clip_factors(norms, max_grad_norm=max_grad_norm)
