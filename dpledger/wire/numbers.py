"""One way to show a number to a person, and one way to hand it to a machine. In the wire contract
because both sides show them: the service's dashboard and the people's commands say "exhausted" at
the same residue."""

from __future__ import annotations

import json
import math

SIGNIFICANT_DIGITS = 6
# A remaining ε under this share of the budget buys nothing (a calibrated run spends its budget to
# the last float, leaving residues such as 1.75309e-08): the silo is shown as exhausted.
EXHAUSTED_SHARE = 1e-6
# From this share of the budget spent on, a silo is near its end: its bar turns amber.
NEAR_SHARE = 0.8


def budget_state(*, spent: float | None, budget: float) -> str:
    """fine, near (NEAR_SHARE of the budget or more spent) or exhausted (what remains is a float's
    residue, or ε is unbounded: None, as the API sends ∞)."""
    if spent is None or not math.isfinite(spent) or budget - spent <= EXHAUSTED_SHARE * budget:
        return "exhausted"
    return "near" if spent >= NEAR_SHARE * budget else "fine"


def remaining_shown(*, remaining: float, budget: float) -> str:
    """The remaining ε as a reader sees it: "exhausted" where it is a residue no round can use."""
    return "exhausted" if remaining <= EXHAUSTED_SHARE * budget else shown(remaining)


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
