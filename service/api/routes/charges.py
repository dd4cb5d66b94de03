"""Charges: the approval a training job asks for before every privacy-consuming step."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Request, Response, status

from dpledger.service.api.deps import FactoryDep, IdPath, PrincipalDep
from dpledger.service.api.metrics import Decision, note_decision
from dpledger.service.api.receipts import SignerDep, receipt
from dpledger.service.api.refusals import Refusal
from dpledger.service.ledger import charges
from dpledger.service.ledger.errors import OverBudget
from dpledger.wire.schemas import (
    ChargeRequest,
    ChargeReserved,
    ChargeSettled,
    OverBudgetResponse,
    finite_or_none,
)

router = APIRouter(tags=["charges"])


@router.post(
    "/v1/silos/{silo_id}/charges",
    status_code=status.HTTP_201_CREATED,
    response_model=ChargeReserved,
    name="reserve_charge",
    responses={409: {"model": OverBudgetResponse, "description": "over budget: nothing was written"}},
)
def reserve_charge(
    silo_id: IdPath, body: ChargeRequest, caller: PrincipalDep, factory: FactoryDep, signer: SignerDep,
    request: Request, response: Response,
) -> ChargeReserved:
    caller.require_silo(silo_id)
    try:
        result = charges.reserve(
            factory, silo_id=silo_id, mechanism=body.mechanism, idempotency_key=body.idempotency_key,
            job_id=body.job_id, round=body.round,
        )
    except OverBudget as refusal:
        request.app.state.refusals.record(silo_id, Refusal(
            at=datetime.now(UTC), job_id=body.job_id, round=body.round,
            epsilon_spent=refusal.epsilon_spent, epsilon_if_approved=refusal.epsilon_if_approved,
        ))
        note_decision(request, Decision(
            outcome="refused", reason="over_budget", silo_id=silo_id, charge_id=None,
            epsilon_spent=refusal.epsilon_spent, epsilon_if_approved=refusal.epsilon_if_approved,
        ))
        raise
    note_decision(request, Decision(
        outcome="approved", reason="replayed" if result.replayed else "reserved", silo_id=silo_id,
        charge_id=result.charge_id, epsilon_spent=result.epsilon_spent,
    ))
    if result.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return ChargeReserved(
        charge_id=result.charge_id, epsilon_spent=result.epsilon_spent, epsilon_remaining=result.epsilon_remaining,
        receipt=receipt(signer, result.position),
    )


def _settle(charge_id: int, caller: PrincipalDep, factory: FactoryDep, signer: SignerDep, *, commit: bool) -> ChargeSettled:
    with factory() as session:
        silo_id = charges.silo_of_charge(session, charge_id)
    caller.require_silo(silo_id)
    result = charges.commit(factory, charge_id=charge_id) if commit else charges.release(factory, charge_id=charge_id)
    return ChargeSettled(
        charge_id=result.charge_id, status=result.status, epsilon_spent=finite_or_none(result.epsilon_spent),
        receipt=receipt(signer, result.position),
    )


@router.post("/v1/charges/{charge_id}/commit", response_model=ChargeSettled, name="commit_charge")
def commit_charge(charge_id: IdPath, caller: PrincipalDep, factory: FactoryDep, signer: SignerDep) -> ChargeSettled:
    """The round ran: the reservation stays spent for good."""
    return _settle(charge_id, caller, factory, signer, commit=True)


@router.post("/v1/charges/{charge_id}/release", response_model=ChargeSettled, name="release_charge")
def release_charge(charge_id: IdPath, caller: PrincipalDep, factory: FactoryDep, signer: SignerDep) -> ChargeSettled:
    """Only when the step never touched the data: the reservation's cost is returned."""
    return _settle(charge_id, caller, factory, signer, commit=False)
