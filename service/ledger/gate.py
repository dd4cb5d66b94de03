"""The budget check of one charge, and the proven ε of a silo's running sum.

A silo is gated one of two ways, fixed before its first charge: by its Rényi filter (the union bound
of accounting/filter.py over the orders and δ shares in its record), or, once it has declared a plan,
by the plan alone (accounting/plans.py: exactly the plan's units, priced by its PLD ε). Both read only
the silo row: O(orders), never O(history). The decision itself is charges.check_budget, shared by
reserve and quote.
"""

from __future__ import annotations

import numpy as np

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger.errors import Conflict
from dpledger.service.ledger.models import Silo
from dpledger.wire.mechanisms import AnyMechanism


class PlanDeviation(Conflict):
    """A charge that is not the next part of the silo's declared plan."""


def spec(silo: Silo) -> rdp_filter.FilterSpec:
    return rdp_filter.FilterSpec.from_json(silo.filter_spec)


def plan(silo: Silo) -> plans.Plan | None:
    return None if silo.plan is None else plans.Plan.from_json(silo.plan)


def _is_empty(running: RunningSum) -> bool:
    return not np.any(running.finite) and not np.any(running.infinite)


def reading(silo: Silo, running: RunningSum) -> rdp_filter.Reading:
    """The proven ε of a running sum of this silo (spent, committed, or a candidate)."""
    by_filter = rdp_filter.read(spec(silo), running.curve(), delta=silo.delta)
    declared = plan(silo)
    if declared is None:
        return by_filter
    # Under a plan, anything run is part of the plan: its PLD ε covers every part of it.
    return rdp_filter.Reading(0.0 if _is_empty(running) else declared.epsilon, by_filter.order)


def follow_plan(silo: Silo, mechanism: AnyMechanism) -> None:
    """On a silo with a declared plan: the charge must be the plan's next units (which it then
    takes), else PlanDeviation. Nothing on a silo without a plan. The caller holds the silo's lock."""
    declared = plan(silo)
    if declared is None:
        return
    try:
        taken = plans.consume(list(declared.segments), used=silo.plan_used, charge=plans.segments(mechanism))
    except plans.PlanMismatch as error:
        raise PlanDeviation(f"departs from the silo's declared plan: {error}") from error
    silo.plan_used += taken

