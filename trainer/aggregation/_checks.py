"""Input checks shared by the aggregation functions: every one fails with a ValueError that names
the argument, the constraint and the value found, never with an `assert`."""

from __future__ import annotations

import math

import torch


def check_updates(updates: torch.Tensor, *, name: str = "updates") -> None:
    """A stacked [K, P] floating tensor of finite updates with K ≥ 1 and P ≥ 1."""
    if not isinstance(updates, torch.Tensor) or updates.dim() != 2:
        shape = tuple(updates.shape) if isinstance(updates, torch.Tensor) else type(updates).__name__
        raise ValueError(f"{name} must be a 2-D tensor [K, P] of stacked updates. Found {shape}.")
    if not updates.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor. Found {updates.dtype}.")
    if updates.shape[0] < 1 or updates.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one update of at least one coordinate. Found {tuple(updates.shape)}.")
    if not bool(torch.isfinite(updates).all()):
        raise ValueError(f"{name} must be finite. Found a nan or an infinite entry.")


def check_mask(mask: torch.Tensor, *, n: int, name: str) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (n,):
        found = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a bool tensor of shape ({n},). Found {found}.")


def check_groups(groups: torch.Tensor, *, n: int, n_groups: int) -> None:
    if not isinstance(groups, torch.Tensor) or groups.dtype not in (torch.int32, torch.int64) or tuple(groups.shape) != (n,):
        found = f"{groups.dtype} {tuple(groups.shape)}" if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise ValueError(f"groups must be an integer tensor of shape ({n},). Found {found}.")
    if n > 0 and (int(groups.min()) < 0 or int(groups.max()) >= n_groups):
        raise ValueError(
            f"groups must be in [0, {n_groups}). Found values from {int(groups.min())} to {int(groups.max())}."
        )


def check_positive(value: float, *, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0. Found {value!r}.")
    return float(value)


def check_non_negative(value: float, *, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0. Found {value!r}.")
    return float(value)


def check_probability(value: float, *, name: str) -> float:
    """In (0, 1]: the range dp-accounting accepts for a sampling rate."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]. Found {value!r}.")
    return float(value)
