"""A fixed plan: its mechanisms as a sequence of units, and its ε from dp-accounting's PLD accountant.

A plan declared in full before any output is a non-adaptive composition, so its privacy loss
distribution is the product of its parts' and dp-accounting's PLD accountant (pessimistic by
construction: its discretisation rounds losses up) bounds its ε at δ. Any prefix of the plan, and
any subset of its units, is a function of the full plan's outputs, so running less of it (stopping
early, releasing a unit that never ran) costs nothing beyond the plan's ε. Only that: an adaptive
choice of what to run next, beyond "stop", is not covered by the plan's ε.

A plan and a filter at once (after = ALONGSIDE, every plan declared today): the silo's δ is split,
PLAN_DELTA_SHARE to the plan's branch (its PLD ε is priced at δ·PLAN_DELTA_SHARE) and the rest to
its Rényi filter's orders (accounting/filter.py, whose shares are scaled by 1 − PLAN_DELTA_SHARE).
The gate reads min(the plan's ε, the filter's reading) while every charge so far follows the plan,
and the filter's reading alone once one does not: a charge off the plan ends the plan's branch,
never the silo (gate_epsilon). The proof is the filter's union bound with one more branch; see
filter.py. Plans declared before (after = AFTER_PLAN) keep their rule: the plan alone, the silo closed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dpledger.service.accounting import cost, reports
from dpledger.service.accounting.events import MechanismError, to_dp_event
from dpledger.wire.mechanisms import (
    AnyMechanism,
    Composed,
    DpSgd,
    Gaussian,
    PoissonSampled,
    SelfComposed,
)

# Fine enough for 1e-3 on 10^4-step DP-SGD (R1: 2.3817); a plan is priced once, at declaration.
PLAN_DISCRETIZATION = 1e-4
MAX_SEGMENTS = 10_000
# The rule of plans declared before a plan and a filter could run together: the plan's ε was the
# silo's whole spend, and nothing outside the plan was ever approved. Such silos keep it.
AFTER_PLAN = "closed"
# Today's: the filter approves alongside the plan and after it, on its share of δ.
ALONGSIDE = "filter"
# The plan's branch's share of δ. 1/2 exactly, so that δ·share and the filter's scaled shares are
# exact in floating point (the shares still never sum past δ). On the bench's 135-record silo
# planned for 20 rounds it reads 1.13 after 3 rounds (the filter at δ/2) and 0.945 × dp-accounting's
# RDP ε after 20 (the plan's PLD ε at δ/2); 0.3 / 0.7 read 1.11 / 0.970 and 1.16 / 0.928.
PLAN_DELTA_SHARE = 0.5

Segment = tuple[str, int]  # (one unit's canonical mechanism JSON, how many in a row)


class PlanMismatch(ValueError):
    pass


def _canonical(mechanism: AnyMechanism) -> str:
    return json.dumps(mechanism.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def segments(mechanism: AnyMechanism) -> list[Segment]:
    """The mechanism as a run-length list of units, in the order they run. A DP-SGD run is its steps,
    each a Poisson-sampled Gaussian; a composition is its parts in order. dpsgd must be resolved."""
    raw = _segments(mechanism)
    merged: list[Segment] = []
    for unit, count in raw:
        if merged and merged[-1][0] == unit:
            merged[-1] = (unit, merged[-1][1] + count)
        else:
            merged.append((unit, count))
    return merged


def _segments(mechanism: AnyMechanism) -> list[Segment]:
    match mechanism:
        case DpSgd(sampling_rate=q, noise_multiplier=sigma, steps=steps):
            if q is None:
                raise MechanismError("mechanism.batch_size", "needs a silo's dataset_size; give sampling_rate or silo_id")
            return [(_canonical(PoissonSampled(sampling_rate=q, event=Gaussian(noise_multiplier=sigma))), steps)]
        case SelfComposed(count=count, event=inner):
            parts = segments(inner)
            if len(parts) == 1:
                return [(parts[0][0], parts[0][1] * count)]
            if len(parts) * count > MAX_SEGMENTS:
                raise MechanismError("mechanism", f"a plan may have at most {MAX_SEGMENTS} distinct runs of units")
            return parts * count
        case Composed(events=events):
            out = [s for e in events for s in _segments(e)]
            if len(out) > MAX_SEGMENTS:
                raise MechanismError("mechanism", f"a plan may have at most {MAX_SEGMENTS} distinct runs of units")
            return out
    return [(_canonical(mechanism), 1)]


def total_units(plan: list[Segment]) -> int:
    return sum(count for _, count in plan)


def consume(plan: list[Segment], *, used: int, charge: list[Segment]) -> int:
    """How many units `charge` takes when `used` units of `plan` are already taken; PlanMismatch (one
    line, naming the unit) when the charge is not exactly the plan's next units."""
    index, offset = 0, used
    while index < len(plan) and offset >= plan[index][1]:
        offset -= plan[index][1]
        index += 1
    taken = 0
    for unit, count in charge:
        if index >= len(plan):
            raise PlanMismatch(f"the plan's {total_units(plan)} units are all used")
        expected, available = plan[index][0], plan[index][1] - offset
        if unit != expected:
            raise PlanMismatch(f"unit {used + taken + 1} of the plan is {expected}, the charge asks for {unit}")
        if count > available:
            nxt = plan[index + 1][0] if index + 1 < len(plan) else None
            raise PlanMismatch(
                f"the charge asks for {count} × {unit} where the plan has {available} left in a row"
                + ("" if nxt is None else f" (then {nxt})")
            )
        taken += count
        offset += count
        if offset == plan[index][1]:
            index, offset = index + 1, 0
    return taken


def pld_epsilon(mechanism: AnyMechanism, *, delta: float, budget: float = cost.MAX_SECONDS) -> float:
    """The plan's ε at δ by dp-accounting's PLD accountant; MechanismError if it cannot price it, or
    not within what is left of one request's price (cost.check, at this finer discretization), or
    if its accountant outruns that price (a guard of its own, ticked PLD by PLD)."""
    too_costly = cost.check(mechanism, pld_discretization=PLAN_DISCRETIZATION, warm=False, budget=budget)
    if too_costly is not None:
        raise MechanismError("mechanism", f"cannot be priced as a plan within one request's bounded work: {too_costly}")
    event = to_dp_event(mechanism)
    accountant = reports.MeteredPLDAccountant(value_discretization_interval=PLAN_DISCRETIZATION)
    if not accountant.supports(event):
        raise MechanismError("mechanism", f"dp-accounting's PLD accountant does not support {type(event).__name__} in this plan")
    price = cost.estimate(mechanism).pld_seconds(PLAN_DISCRETIZATION)
    try:
        with cost.guard("mechanism", price=price, slack=cost.PART_SLACK, message=(
                f"cannot be priced as a plan within one request's bounded work: dp-accounting's PLD accountant "
                f"outran its price ({price:.2g} s of CPU) and was stopped")):
            accountant.compose(event)
            return float(accountant.get_epsilon(delta))
    except (ValueError, ArithmeticError, MemoryError) as error:
        if isinstance(error, MechanismError):
            raise
        raise MechanismError(
            "mechanism", f"dp-accounting's PLD accountant failed on this plan: {type(error).__name__}"
        ) from error


@dataclass(frozen=True)
class Plan:
    mechanism: str  # the resolved plan, as declared (JSON)
    segments: tuple[Segment, ...]
    epsilon: float  # its PLD ε at the silo's δ × delta_share
    after: str = ALONGSIDE
    delta_share: float = PLAN_DELTA_SHARE  # 1 for a plan under AFTER_PLAN (it held the whole δ)

    @property
    def units(self) -> int:
        return total_units(list(self.segments))

    @property
    def alongside(self) -> bool:
        """Whether the silo's filter approves alongside this plan (else: the plan alone, closed)."""
        return self.after == ALONGSIDE

    @property
    def filter_share(self) -> float:
        """The share of δ the silo's filter holds beside this plan."""
        return 1.0 - self.delta_share if self.alongside else 0.0

    def to_json(self) -> str:
        body = {"mechanism": json.loads(self.mechanism), "segments": [list(s) for s in self.segments],
                "epsilon": self.epsilon, "after": self.after, "accountant": f"dp_accounting.pld@{PLAN_DISCRETIZATION}"}
        if self.alongside:
            body["delta_share"] = self.delta_share
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        return cls(
            mechanism=json.dumps(data["mechanism"], sort_keys=True, separators=(",", ":")),
            segments=tuple((str(u), int(c)) for u, c in data["segments"]),
            epsilon=float(data["epsilon"]),
            after=str(data["after"]),
            delta_share=float(data.get("delta_share", 1.0)),
        )


def follows(plan: Plan, *, used: int, charge: list[Segment]) -> int | None:
    """How many units `charge` takes as the plan's next units, or None where it leaves the plan."""
    try:
        return consume(list(plan.segments), used=used, charge=charge)
    except PlanMismatch:
        return None


def gate_epsilon(plan: Plan | None, *, on_plan: bool, ran: bool, by_filter: float) -> float:
    """The gate's ε of a running sum: `by_filter` is the silo's filter's reading of it (on the
    filter's share of δ), `on_plan` whether every charge in it follows the plan, `ran` whether it
    holds any charge. Shared by the gate and by the receipts' recomposition."""
    if plan is None:
        return by_filter
    if not plan.alongside:  # the rule before: the plan alone
        return plan.epsilon if ran else 0.0
    return min(plan.epsilon, by_filter) if on_plan and ran else by_filter
