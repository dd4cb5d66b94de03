"""The mechanism dicts the aggregation steps declare, typed as they go on the wire (docs/ARCHITECTURE.md,
"Mechanisms on the wire"); the service validates them again before it charges anything."""

from __future__ import annotations

from typing import Literal, TypedDict


class GaussianMechanism(TypedDict):
    type: Literal["gaussian"]
    noise_multiplier: float
