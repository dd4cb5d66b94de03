"""What a mechanism would cost, and the noise that fits a budget, before anyone spends."""

from __future__ import annotations

from fastapi import APIRouter

from dpledger.service.accounting import rdp, reports
from dpledger.service.accounting.events import MechanismError, resolve
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.api.deps import READERS, FactoryDep, PrincipalDep
from dpledger.service.ledger import silos
from dpledger.service.ledger.errors import InvalidRequest
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
    silo = None
    if body.silo_id is not None:
        caller.require_silo(body.silo_id, also=READERS)  # a silo's spend is a budget: coordinators may not see it
        with factory() as session:
            silo = silos.get(session, body.silo_id)
    delta = body.delta if body.delta is not None else (silo.delta if silo is not None else None)
    if delta is None:
        raise InvalidRequest("delta", "is required when no silo_id is given")
    try:
        mechanism = resolve(body.mechanism, dataset_size=None if silo is None else silo.dataset_size)
        curve = rdp.rdp_curve(mechanism)
    except MechanismError as error:
        raise InvalidRequest(error.field, error.message) from error
    alone = rdp.guarantee(curve, delta=delta)
    pld = reports.pld_epsilon(mechanism, delta=delta)
    answer = QuoteResponse(
        epsilon=finite_or_none(alone.epsilon), order=alone.order, rho=alone.rho,
        epsilon_pld=pld.epsilon, pld_note=pld.unsupported_reason, delta=delta,
    )
    if silo is not None:
        spent = RunningSum.from_json(silo.rdp_spent)
        answer.silo_epsilon_spent = finite_or_none(rdp.epsilon(spent.curve(), delta=silo.delta)[0])
        answer.epsilon_if_approved = finite_or_none(rdp.epsilon(spent.add(curve).curve(), delta=silo.delta)[0])
    return answer


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
