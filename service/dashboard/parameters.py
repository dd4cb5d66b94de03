"""σ, q and steps of a stored mechanism, as an auditor reads them off the charges table.

Read from the resolved mechanism JSON (q as the service computed it from the registered size).
Only shapes with one σ and one q have them: DP-SGD, a Poisson-sampled Gaussian, a Gaussian, and
any of those self-composed; anything else (a composition of several kinds, a search) shows none
rather than a misleading summary of one part. An edited, unreadable row shows none too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Parameters:
    noise_multiplier: float | None = None
    sampling_rate: float | None = None
    steps: int | None = None


NONE = Parameters()


def parameters(stored: str) -> Parameters:
    try:
        mechanism = json.loads(stored)
    except ValueError:
        return NONE
    return _of(mechanism) if isinstance(mechanism, dict) else NONE


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _of(mechanism: dict[str, Any]) -> Parameters:
    kind = mechanism.get("type")
    if kind == "dpsgd":
        return Parameters(_number(mechanism.get("noise_multiplier")), _number(mechanism.get("sampling_rate")),
                          _count(mechanism.get("steps")))
    if kind == "gaussian":
        return Parameters(_number(mechanism.get("noise_multiplier")), None, 1)
    if kind == "poisson_sampled" and isinstance(mechanism.get("event"), dict) and mechanism["event"].get("type") == "gaussian":
        return Parameters(_number(mechanism["event"].get("noise_multiplier")), _number(mechanism.get("sampling_rate")), 1)
    if kind == "self_composed" and isinstance(mechanism.get("event"), dict):
        inner, count = _of(mechanism["event"]), _count(mechanism.get("count"))
        if inner == NONE or count is None or inner.steps is None:
            return NONE
        return Parameters(inner.noise_multiplier, inner.sampling_rate, inner.steps * count)
    return NONE
