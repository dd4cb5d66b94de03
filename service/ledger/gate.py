"""The budget check of one charge, and the proven ε of a silo's running sum.

A silo is gated by its Rényi filter (the union bound of accounting/filter.py over the orders and δ
shares in its record) and, where it declared a plan before its first charge, by the plan too: the
gate reads the lower of the plan's PLD ε and the filter's reading (on the filter's share of δ) while
every charge so far follows the plan, and the filter's alone once a charge left it (plan_ended_seq;
accounting/plans.py, ALONGSIDE). A plan declared before that rule (AFTER_PLAN) gates its silo alone.
All of it reads only the silo row: O(orders), never O(history). The decision itself is
charges.check_budget, shared by reserve and quote.

A silo registered without a horizon holds no filter until its first charge (filter_seq 0, its
create entry covers none): that charge fixes it from its own curve (filter.first_charge_spec, where
why that is sound is written), and until then every price it is quoted is read under the filter
that charge would fix. The charge's reservation writes the filter entry that covers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans, rdp
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger.errors import Conflict
from dpledger.service.store.models import Silo, SiloRecord
from dpledger.wire.mechanisms import AnyMechanism


class PlanDeviation(Conflict):
    """A charge that is not the next part of the silo's declared plan."""


# filter_seq of a silo whose filter its first charge fixes (chain.create_fields covers no filter then).
PENDING_SEQ = 0


def pending(silo: Silo | SiloRecord) -> bool:
    """Whether the silo's filter is still to be fixed by its first charge."""
    return silo.filter_seq == PENDING_SEQ


def refittable(silo: Silo | SiloRecord) -> bool:
    """Whether the silo registered with a horizon, whose filter its first charge may still refit
    (filter.refit_spec), holds no charge yet. Read from what the chain decides (filter_seq, chain_seq,
    the plan, sealed_seq and retired_seq are replayed or hashed, ledger/seals.py): its chain is the
    create entry and at most a plan entry, so an edited row cannot reopen a filter charges were read under."""
    return (silo.filter_seq == 1 and silo.registered_filter is None and silo.sealed_seq is None
            and silo.retired_seq is None and not closed_by_plan(silo)
            and silo.chain_seq == 1 + (silo.plan is not None))


def open_to_first(silo: Silo | SiloRecord) -> bool:
    """Whether the silo's next charge, its first, decides the filter it is read under."""
    return pending(silo) or refittable(silo)


def first_charge(silo: Silo | SiloRecord, curve: np.ndarray, mechanism: AnyMechanism) -> rdp_filter.FirstCharge | None:
    """The charge as the filter it would fix or refit reads it, where the silo's filter is still open
    to its first charge (open_to_first); else None."""
    if not open_to_first(silo):
        return None
    return rdp_filter.FirstCharge(curve, rdp.training_unit(mechanism), trains=rdp.trains(mechanism),
                                  digest=rdp_filter.mechanism_digest(mechanism))


def spec(silo: Silo | SiloRecord, *, first: rdp_filter.FirstCharge | None = None) -> rdp_filter.FilterSpec:
    """The filter the gate reads: on the share of δ a declared plan leaves it; on a silo whose first
    charge (`first`, from first_charge) fixes or may refit its filter, the one that charge would leave."""
    fixed = fixed_spec(silo, first=first)
    declared = plan(silo)
    return fixed if declared is None or not declared.alongside else rdp_filter.scaled(fixed, declared.filter_share)


def fixed_spec(silo: Silo | SiloRecord, *, first: rdp_filter.FirstCharge | None = None) -> rdp_filter.FilterSpec:
    """The filter as the silo holds it, its shares not yet scaled by a plan's (what its record stores;
    fitted to the δ it is read on, fitted_delta): on a silo whose first charge (`first`) fixes or may
    refit its filter, the one that charge would leave."""
    if first is not None and pending(silo):
        return rdp_filter.first_charge_spec(epsilon=silo.epsilon, delta=fitted_delta(silo), first=first.curve,
                                            unit=first.unit, rounds_goal=_rounds_goal(silo))
    stored = rdp_filter.FilterSpec.from_json(silo.filter_spec)
    if first is not None and refittable(silo):
        return rdp_filter.refit_spec(stored, epsilon=silo.epsilon, delta=fitted_delta(silo), first=first,
                                     rounds_goal=_rounds_goal(silo))
    return stored


def _rounds_goal(silo: Silo | SiloRecord) -> float | None:
    """The share of its units a filter fixed now holds with its goals scaled (filter.allocate): none
    beside a plan, which buys the rounds itself (its PLD ε); read only where a first charge fixes one."""
    declared = plan(silo)
    return None if declared is not None and declared.alongside else rdp_filter.ROUNDS_GOAL


def fitted_delta(silo: Silo | SiloRecord) -> float:
    """The δ a first charge fits the filter to: the share a declared plan leaves it, the δ the gate
    then reads it on (spec). Fitted on the whole δ and read on half, its path ends where the whole δ's
    would: a central job at q = 0.001, σ 0.644 that left its plan afforded none of the 112 steps
    dp-accounting affords on that half, and 109 fitted on it (tests/service/api/test_plan_and_filter_api.py)."""
    declared = plan(silo)
    return silo.delta if declared is None or not declared.alongside else silo.delta * declared.filter_share


def plan(silo: Silo | SiloRecord) -> plans.Plan | None:
    return None if silo.plan is None else plans.Plan.from_json(silo.plan)


def closed_by_plan(silo: Silo | SiloRecord) -> bool:
    """A silo on a plan declared under the rule before (plans.AFTER_PLAN): the plan alone gates it."""
    declared = plan(silo)
    return declared is not None and not declared.alongside


def gated_on(silo: Silo) -> Literal["rdp_filter", "plan", "plan_and_filter"]:
    """What the silo's approvals are checked against now (the wire's gated_on)."""
    if closed_by_plan(silo):
        return "plan"
    return "plan_and_filter" if on_plan(silo) else "rdp_filter"


def on_plan(silo: Silo | SiloRecord) -> bool:
    """Whether the plan's branch is alive: a plan declared, and no charge so far off it."""
    return silo.plan is not None and silo.plan_ended_seq is None


@dataclass(frozen=True)
class PlanStep:
    """What a charge does to the silo's plan: the units it takes, and whether the branch lives on."""

    taken: int
    on_plan: bool


def plan_step(silo: Silo | SiloRecord, mechanism: AnyMechanism) -> PlanStep:
    """The charge's step along the silo's plan (no plan, or a branch ended: off it). Reads only."""
    declared = plan(silo)
    if declared is None or not on_plan(silo):
        return PlanStep(0, False)
    taken = plans.follows(declared, used=silo.plan_used, charge=plans.segments(mechanism))
    return PlanStep(0, False) if taken is None else PlanStep(taken, True)


def plan_path(silo: Silo, mechanisms: list[AnyMechanism | None]) -> list[bool]:
    """Whether the branch is alive after each prefix of these charges (None: a round that charges
    nothing), from the silo as it stands: entry 0 is now."""
    declared = plan(silo)
    alive, used, out = on_plan(silo), silo.plan_used, [on_plan(silo)]
    for mechanism in mechanisms:
        if alive and mechanism is not None and declared is not None:
            taken = plans.follows(declared, used=used, charge=plans.segments(mechanism))
            alive, used = taken is not None, used + (taken or 0)
        out.append(alive)
    return out


def _is_empty(running: RunningSum) -> bool:
    return not np.any(running.finite) and not np.any(running.infinite)


def reading(
    silo: Silo | SiloRecord, running: RunningSum, *, first: rdp_filter.FirstCharge | None = None, alive: bool | None = None
) -> rdp_filter.Reading:
    """The proven ε of a running sum of this silo (spent, committed, or a candidate); `first`: the
    silo's first charge where the sum holds it and its filter is still open to it (first_charge);
    `alive`: whether every charge in the sum follows the plan (default: as the silo stands, on_plan)."""
    by_filter = rdp_filter.read(spec(silo, first=first), running.curve(), delta=silo.delta)
    declared = plan(silo)
    if declared is None:
        return by_filter
    eps = plans.gate_epsilon(declared, on_plan=on_plan(silo) if alive is None else alive,
                             ran=not _is_empty(running), by_filter=by_filter.epsilon)
    return rdp_filter.Reading(eps, by_filter.order)


def follow_plan(silo: Silo | SiloRecord, mechanism: AnyMechanism) -> PlanStep:
    """The charge's step along the silo's plan. On a plan declared under the rule before
    (AFTER_PLAN) the charge must be the plan's next units, else PlanDeviation (a 409)."""
    step = plan_step(silo, mechanism)
    if closed_by_plan(silo) and not step.on_plan:
        declared = plan(silo)
        assert declared is not None
        try:
            plans.consume(list(declared.segments), used=silo.plan_used, charge=plans.segments(mechanism))
        except plans.PlanMismatch as error:
            raise PlanDeviation(f"departs from the silo's declared plan: {error}") from error
    return step


def take(silo: Silo | SiloRecord, step: PlanStep, *, seq: int) -> None:
    """Records an approved charge's step: its units taken, or (the first charge off an alive plan's
    branch, whose reserve entry is `seq`) the branch's end. The caller holds the silo's lock."""
    if step.on_plan:
        silo.plan_used += step.taken
    elif on_plan(silo):
        silo.plan_ended_seq = seq

