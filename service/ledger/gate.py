"""The budget check of one charge, and the proven ε of a silo's running sum.

A silo is gated one of two ways, fixed before its first charge: by its Rényi filter (the union bound
of accounting/filter.py over the orders and δ shares in its record), or, once it has declared a plan,
by the plan alone (accounting/plans.py: exactly the plan's units, priced by its PLD ε). Both read only
the silo row: O(orders), never O(history). The decision itself is charges.check_budget, shared by
reserve and quote.

A silo registered without a horizon holds no filter until its first charge (filter_seq 0, its
create entry covers none): that charge fixes it from its own curve (filter.first_charge_spec, where
why that is sound is written), and until then every price it is quoted is read under the filter
that charge would fix. The charge's reservation writes the filter entry that covers it.
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


# filter_seq of a silo whose filter its first charge fixes (chain.create_fields covers no filter then).
PENDING_SEQ = 0


def pending(silo: Silo) -> bool:
    """Whether the silo's filter is still to be fixed by its first charge."""
    return silo.filter_seq == PENDING_SEQ


def spec(silo: Silo, *, first: np.ndarray | None = None) -> rdp_filter.FilterSpec:
    """The silo's filter; on a pending silo, the one its first charge (of curve `first`) would fix."""
    if pending(silo) and first is not None:
        return rdp_filter.first_charge_spec(epsilon=silo.epsilon, delta=silo.delta, first=first)
    return rdp_filter.FilterSpec.from_json(silo.filter_spec)


def plan(silo: Silo) -> plans.Plan | None:
    return None if silo.plan is None else plans.Plan.from_json(silo.plan)


def _is_empty(running: RunningSum) -> bool:
    return not np.any(running.finite) and not np.any(running.infinite)


def reading(silo: Silo, running: RunningSum, *, first: np.ndarray | None = None) -> rdp_filter.Reading:
    """The proven ε of a running sum of this silo (spent, committed, or a candidate); `first`: the
    curve of the silo's first charge where the sum holds it and the silo is still pending."""
    by_filter = rdp_filter.read(spec(silo, first=first), running.curve(), delta=silo.delta)
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

