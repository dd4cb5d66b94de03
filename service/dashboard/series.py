"""ε over time from a silo's history: the chart's points, replayed from the stored entries.

An entry stores ε of committed + reserved charges after it; ε of committed charges alone is not
stored, so it is recomputed by composing the curves of the charges committed so far, through the
conversion the ledger uses for that silo (its gate's reading, passed in as `convert`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_from_json
from dpledger.service.dashboard.svg import Point


@dataclass(frozen=True)
class Step:
    seq: int
    event: str  # an EntryEvent value
    charge_rdp: str | None  # the charge's curve JSON; None for the silo's genesis entry
    epsilon_spent: float
    epsilon_dp_accounting: float | None = None  # the history's reference ε after the entry (None: unknown)


def points(steps: Iterable[Step], *, convert: Callable[[RunningSum], float]) -> list[Point]:
    committed = RunningSum.empty(len(rdp.ORDERS))
    eps_committed = 0.0
    out = []
    for step in steps:
        if step.event == "commit" and step.charge_rdp is not None:
            committed = committed.add(curve_from_json(step.charge_rdp))
            eps_committed = convert(committed)
        reference = math.nan if step.epsilon_dp_accounting is None else step.epsilon_dp_accounting
        out.append(Point(seq=step.seq, committed=eps_committed, spent=step.epsilon_spent, reference=reference))
    return out


def charge_epsilon(charge_rdp: str, *, delta: float) -> float:
    """ε of one charge alone at the silo's δ: what that charge would cost a fresh ledger."""
    return rdp.epsilon(curve_from_json(charge_rdp), delta=delta)[0]
