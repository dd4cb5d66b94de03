"""What a mechanism would cost, and the noise that fits a budget, before anyone spends."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans, rdp, reports
from dpledger.service.accounting.events import MechanismError, resolve
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.api.deps import READERS, FactoryDep, PrincipalDep
from dpledger.service.ledger import gate, silos
from dpledger.service.ledger.errors import InvalidRequest
from dpledger.service.ledger.models import Charge
from dpledger.wire.mechanisms import AnyMechanism
from dpledger.wire.schemas import (
    CalibrateRequest,
    CalibrateResponse,
    QuoteRequest,
    QuoteResponse,
    finite_or_none,
)

router = APIRouter(prefix="/v1", tags=["quotes"])


@router.post("/quote", response_model=QuoteResponse, name="quote")
def quote(body: QuoteRequest, caller: PrincipalDep, factory: FactoryDep) -> QuoteResponse:
    silo, holds_charges = None, False
    if body.silo_id is not None:
        caller.require_silo(body.silo_id, also=READERS)  # a silo's spend is a budget: coordinators may not see it
        with factory() as session:
            silo = silos.get(session, body.silo_id)
            holds_charges = session.scalars(select(Charge.id).where(Charge.silo_id == silo.id)).first() is not None
    delta = body.delta if body.delta is not None else (silo.delta if silo is not None else None)
    if delta is None:
        raise InvalidRequest("delta", "is required when no silo_id is given")
    try:
        mechanism = resolve(body.mechanism, dataset_size=None if silo is None else silo.dataset_size)
        curve = rdp.rdp_curve(mechanism)
        certified = rdp.certified_curve(mechanism)
    except MechanismError as error:
        raise InvalidRequest(error.field, error.message) from error
    alone = rdp.guarantee(curve, delta=delta)
    pld = reports.pld_epsilon(mechanism, delta=delta)
    answer = QuoteResponse(
        epsilon=finite_or_none(alone.epsilon), order=alone.order, rho=alone.rho,
        epsilon_pld=pld.epsilon, pld_note=pld.unsupported_reason, delta=delta,
    )
    _plan_price(answer, mechanism, delta=delta, silo_has_plan=silo is not None and silo.plan is not None,
                holds_charges=holds_charges)
    if silo is None:
        _, best = rdp.epsilon(certified, delta=delta)
        spec = rdp_filter.spread_spec(best, source="horizon")
        answer.epsilon_rdp_proven = finite_or_none(rdp_filter.read(spec, certified, delta=delta).epsilon)
        return answer
    # The silo's own gate, on the same running sum and curve a charge would use.
    spent = RunningSum.from_json(silo.rdp_spent)
    answer.silo_epsilon_spent = finite_or_none(gate.reading(silo, spent).epsilon)
    answer.epsilon_if_approved = finite_or_none(gate.reading(silo, spent.add(certified)).epsilon)
    proven = rdp_filter.read(gate.spec(silo), spent.add(certified).curve(), delta=silo.delta)
    answer.epsilon_rdp_proven = finite_or_none(proven.epsilon)
    answer.gated_on = "rdp_filter" if silo.plan is None else "plan"
    return answer


def _plan_price(
    answer: QuoteResponse, mechanism: AnyMechanism, *, delta: float, silo_has_plan: bool, holds_charges: bool
) -> None:
    if silo_has_plan:
        answer.plan_note = "the silo has declared its plan already"
    elif holds_charges:
        answer.plan_note = "the silo holds charges: a plan must be declared before the first one"
    else:
        try:
            answer.epsilon_plan = finite_or_none(plans.pld_epsilon(mechanism, delta=delta).epsilon)
        except MechanismError as error:
            answer.plan_note = error.message


@router.post("/calibrate", response_model=CalibrateResponse, name="calibrate")
def calibrate(body: CalibrateRequest, caller: PrincipalDep) -> CalibrateResponse:
    """The smallest DP-SGD noise multiplier whose ε at δ never exceeds the target."""
    try:
        sigma, eps = reports.calibrate_dpsgd_noise(
            epsilon=body.epsilon, delta=body.delta, sampling_rate=body.sampling_rate, steps=body.steps
        )
    except MechanismError as error:
        raise InvalidRequest(error.field, error.message) from error
    return CalibrateResponse(noise_multiplier=sigma, epsilon=eps)
