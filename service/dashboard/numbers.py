"""One way to show a number to a person, and one way to hand it to a machine."""

from __future__ import annotations

import json
import math

SIGNIFICANT_DIGITS = 6


def shown(value: float | None) -> str:
    """What a reader sees: 6 significant digits everywhere, ∞ for an unbounded ε."""
    if value is None:
        return "—"
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


def exact(value: float | None) -> str:
    """What a `data-` attribute holds: the JSON the API would send for the same value (shortest
    round-trip repr, null for ∞), so a test compares the page with the API without rounding."""
    if value is None or not math.isfinite(value):
        return "null"
    return json.dumps(value)
