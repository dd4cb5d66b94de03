"""Charges: the approval a training job asks for before every privacy-consuming step."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from service.api.deps import FactoryDep, PrincipalDep
from service.api.schemas import ChargeRequest, ChargeReserved, ChargeSettled, OverBudgetResponse, finite_or_none
from service.ledger import charges

router = APIRouter(tags=["charges"])


@router.post(
    "/v1/silos/{silo_id}/charges",
    status_code=status.HTTP_201_CREATED,
    response_model=ChargeReserved,
    name="reserve_charge",
    responses={409: {"model": OverBudgetResponse, "description": "over budget: nothing was written"}},
)
def reserve_charge(
    silo_id: int, body: ChargeRequest, caller: PrincipalDep, factory: FactoryDep, response: Response
) -> ChargeReserved:
    caller.require_silo(silo_id)
    result = charges.reserve(
        factory, silo_id=silo_id, mechanism=body.mechanism, idempotency_key=body.idempotency_key,
        job_id=body.job_id, round=body.round,
    )
    if result.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return ChargeReserved(
        charge_id=result.charge_id, epsilon_spent=result.epsilon_spent, epsilon_remaining=result.epsilon_remaining
    )


def _settle(charge_id: int, caller: PrincipalDep, factory: FactoryDep, *, commit: bool) -> ChargeSettled:
    with factory() as session:
        silo_id = charges.silo_of_charge(session, charge_id)
    caller.require_silo(silo_id)
    result = charges.commit(factory, charge_id=charge_id) if commit else charges.release(factory, charge_id=charge_id)
    return ChargeSettled(charge_id=result.charge_id, status=result.status, epsilon_spent=finite_or_none(result.epsilon_spent))


@router.post("/v1/charges/{charge_id}/commit", response_model=ChargeSettled, name="commit_charge")
def commit_charge(charge_id: int, caller: PrincipalDep, factory: FactoryDep) -> ChargeSettled:
    """The round ran: the reservation stays spent for good."""
    return _settle(charge_id, caller, factory, commit=True)


@router.post("/v1/charges/{charge_id}/release", response_model=ChargeSettled, name="release_charge")
def release_charge(charge_id: int, caller: PrincipalDep, factory: FactoryDep) -> ChargeSettled:
    """Only when the step never touched the data: the reservation's cost is returned."""
    return _settle(charge_id, caller, factory, commit=False)
