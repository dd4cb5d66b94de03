"""IFCA's private cluster selection, as the knobs a silo's engine reads (`trainer.federated.ifca`
explains the mechanism); apart from IFCA so that the engine, which every algorithm uses, imports
none of them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ClusterSelection:
    """The private selection's knobs: σ_s, the clip C_ℓ of each record's k-vector of losses, and
    the expected sample size B_s (None: every record, q_s = 1)."""

    # σ_s = 1 forms the four rotation clusters of 20 digits silos within ~6 rounds; σ_s = 2 needs
    # ~10 and σ_s = 5 over 20 (measured, seeds 0-2), at a quarter and a 25th of the RDP cost.
    noise_multiplier: float = 1.0
    loss_clip: float = 5.0
    batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "loss_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"selection {name} must be finite and > 0. Found {value}.")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ValueError(f"selection batch_size must be positive. Found {self.batch_size}.")
