"""K silos' datasets as one padded tensor, the layout the simulator's batched engine reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dpledger.trainer.federated.config import Task


@dataclass(frozen=True)
class PaddedSilos:
    """K silos' datasets, padded along the record dimension to the largest one.

    Padding rows are never sampled (indices come from each silo's own sampler, below n_k) and are
    masked out of evaluation.
    """

    x: torch.Tensor  # [K, n_max, d] float32
    y: torch.Tensor  # [K, n_max] int64 (classification) or float32 (regression)
    sizes: list[int]  # n_k

    @property
    def num_silos(self) -> int:
        return len(self.sizes)

    @property
    def mask(self) -> torch.Tensor:
        """[K, n_max] bool: True on real records."""
        positions = torch.arange(self.x.shape[1], device=self.x.device)
        sizes = torch.tensor(self.sizes, device=self.x.device)
        return positions.unsqueeze(0) < sizes.unsqueeze(1)

    @classmethod
    def from_tensors(
        cls,
        xs: Sequence[torch.Tensor],
        ys: Sequence[torch.Tensor],
        *,
        task: Task,
        device: torch.device,
        allow_empty: bool,
    ) -> PaddedSilos:
        if len(xs) == 0 or len(xs) != len(ys):
            raise ValueError(f"Need one x and one y tensor per silo (at least one). Found {len(xs)} x, {len(ys)} y.")
        features = int(xs[0].shape[-1])
        for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if x.dim() != 2 or x.shape[1] != features:
                raise ValueError(f"Silo {k}: x must be [n, {features}]-shaped. Found {tuple(x.shape)}.")
            if y.dim() != 1 or y.shape[0] != x.shape[0]:
                raise ValueError(f"Silo {k}: y must be [n] with n = {x.shape[0]}. Found {tuple(y.shape)}.")
            if x.shape[0] == 0 and not allow_empty:
                raise ValueError(f"Silo {k} has no training records.")
        sizes = [int(x.shape[0]) for x in xs]
        n_max = max(max(sizes), 1)
        x_pad = torch.zeros(len(xs), n_max, features, dtype=torch.float32, device=device)
        y_dtype = torch.int64 if task == "classification" else torch.float32
        y_pad = torch.zeros(len(xs), n_max, dtype=y_dtype, device=device)
        for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
            x_pad[k, : sizes[k]] = x.to(device=device, dtype=torch.float32)
            y_pad[k, : sizes[k]] = y.to(device=device, dtype=y_dtype)
        return cls(x=x_pad, y=y_pad, sizes=sizes)
