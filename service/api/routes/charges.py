"""Charges: the approval a training job asks for before every privacy-consuming step."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.security import HTTPAuthorizationCredentials

from dpledger.service.accounting import cost
from dpledger.service.accounting.events import MechanismError
from dpledger.service.api.deps import READERS, BearerDep, DbDep, IdPath, Principal, PrincipalDep, authenticate
from dpledger.service.api.direct import direct_route
from dpledger.service.api.errors import spend_route
from dpledger.service.api.known import Known
from dpledger.service.api.metrics import Decision, note_decision
from dpledger.service.api.receipts import SignerDep, receipt
from dpledger.service.api.refusals import Refusal
from dpledger.service.ledger import charges
from dpledger.service.ledger.errors import OverBudget, Unauthorized
from dpledger.service.store.db import Database
from dpledger.service.store.models import Role
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.schemas import (
    ChargeRequest,
    ChargeReserved,
    ChargeSettled,
    Text,
    finite_or_none,
)

router = APIRouter(tags=["charges"])
# Who settles a charge: its silo, and an admin recovering a stranded reservation.
SETTLERS = (Role.admin,)


def _answer(found: charges.ChargeView, signer: SignerDep | None) -> ChargeReserved:
    """`signer`: the reserve entry's receipt goes with a single charge (a list leaves it out)."""
    return ChargeReserved(
        charge_id=found.charge_id, status=found.status, replayed=found.replayed,
        epsilon=finite_or_none(found.epsilon), epsilon_spent=finite_or_none(found.epsilon_spent),
        epsilon_dp_accounting=finite_or_none(found.epsilon_dp_accounting), epsilon_remaining=found.epsilon_remaining,
        job_id=found.charge.job_id, round=found.charge.round,
        attempt_id=found.charge.attempt_id, receipt=None if signer is None else receipt(signer, found.position),
    )


@spend_route(
    router, "/v1/silos/{silo_id}/charges", model=ChargeReserved, name="reserve_charge",
    replay="the charge as it stands, no new approval", over_budget="nothing was written",
    route_class=direct_route("silo_id", ChargeRequest),
)
def reserve_charge(
    silo_id: IdPath, body: ChargeRequest, credentials: BearerDep, request: Request,
) -> Response:
    """201: a fresh reservation, the only answer that lets a round touch the data. 200 with
    `replayed: true`: this idempotency key was seen before; `status` says what became of its charge."""
    # The hot path, in one hop to the threadpool: no sync dependency (each would be a hop of its
    # own), and a plainly valid request read by the route itself (api/direct.py). A key and silo
    # this process has served before: priced at once, then one write transaction; else the key, the
    # silo and its earlier charge are read in one session first.
    with cost.guard("mechanism"):  # pricing and the approval under one CPU bound (cost.py)
        return _reserve_charge(silo_id, body, credentials, request)


def _reserve_charge(
    silo_id: int, body: ChargeRequest, credentials: HTTPAuthorizationCredentials | None, request: Request,
) -> Response:
    db: Database = request.app.state.db
    known: Known = request.app.state.known
    fast = _start_known(request, known, silo_id, body, credentials)
    started: charges.ChargeView | charges.Started
    if fast is not None:
        caller, started = fast
    else:
        with db.read() as session:
            caller = authenticate(request, session, credentials)
            caller.require_silo(silo_id)
            started = charges.start_reserve(
                session, silo_id=silo_id, mechanism=body.mechanism, idempotency_key=body.idempotency_key,
                job_id=body.job_id, round=body.round,
            )
        if credentials is not None and isinstance(started, charges.Started):
            known.remember(credentials, caller, silo_id, started.terms)
    try:
        result = started if isinstance(started, charges.ChargeView) else charges.finish_reserve(
            db, started, silo_id=silo_id, idempotency_key=body.idempotency_key, job_id=body.job_id, round=body.round,
            key_id=caller.key_id, attempt_id=body.attempt_id,
        )
    except Unauthorized:
        # Revoked since this process kept it: from now on the key is read (and refused) before any pricing.
        known.forget(credentials)
        raise
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
    headers = {"Idempotent-Replayed": "true"} if result.replayed else {}
    # The answer is built here from typed values, so it is serialised once instead of being
    # validated again against the response model (FastAPI skips that for a Response).
    return Response(
        _answer(result, request.app.state.signer).model_dump_json(by_alias=True),
        status_code=status.HTTP_200_OK if result.replayed else status.HTTP_201_CREATED,
        headers=headers, media_type="application/json",
    )


def _start_known(
    request: Request, known: Known, silo_id: int, body: ChargeRequest, credentials: HTTPAuthorizationCredentials | None,
) -> tuple[Principal, charges.Started] | None:
    """The request priced with no read, where this process knows the key and the silo; else None."""
    caller = known.principal(credentials)
    terms = known.terms(silo_id)
    if caller is None or terms is None:
        return None
    caller.require_silo(silo_id)
    request.state.principal = caller
    try:
        return caller, charges.start_known(terms, mechanism=body.mechanism, job_id=body.job_id, round=body.round)
    except MechanismError:
        return None  # the read path answers it: a replay of the key first, as always, else this error


@router.get("/v1/charges/{charge_id}", response_model=ChargeReserved, name="get_charge")
def get_charge(charge_id: IdPath, caller: PrincipalDep, db: DbDep, signer: SignerDep) -> ChargeReserved:
    """The charge as it stands (its silo, admin, auditor)."""
    return _answer(charges.get(db, charge_id, silo_scope=caller.silo_scope(also=READERS)), signer)


@router.get("/v1/silos/{silo_id}/charges", response_model=list[ChargeReserved], name="list_charges")
def list_charges(
    silo_id: IdPath,
    caller: PrincipalDep,
    db: DbDep,
    charge_status: Annotated[ChargeStatus | None, Query(alias="status")] = None,
    job_id: Annotated[Text | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[ChargeReserved]:
    """A silo's charges by id, e.g. `?status=reserved` for the open reservations a crashed worker
    left behind (its silo, admin, auditor)."""
    caller.require_silo(silo_id, also=READERS)
    return [_answer(c, None) for c in charges.list_for_silo(db, silo_id, status=charge_status, job_id=job_id, limit=limit)]


def _settled(result: charges.Settlement, signer: SignerDep) -> ChargeSettled:
    return ChargeSettled(
        charge_id=result.charge_id, status=result.status, epsilon_spent=finite_or_none(result.epsilon_spent),
        epsilon_dp_accounting=finite_or_none(result.epsilon_dp_accounting), receipt=receipt(signer, result.position),
    )


@router.post("/v1/charges/{charge_id}/commit", response_model=ChargeSettled, name="commit_charge")
def commit_charge(charge_id: IdPath, caller: PrincipalDep, db: DbDep, signer: SignerDep) -> ChargeSettled:
    """The round ran: the reservation stays spent for good."""
    caller.require(Role.silo, *SETTLERS)
    scope = caller.silo_scope(also=SETTLERS)
    return _settled(charges.commit(db, charge_id=charge_id, silo_scope=scope, key_id=caller.key_id), signer)


@router.post("/v1/charges/{charge_id}/release", response_model=ChargeSettled, name="release_charge")
def release_charge(charge_id: IdPath, caller: PrincipalDep, db: DbDep, signer: SignerDep) -> ChargeSettled:
    """Only when the step never touched the data: the reservation's cost is returned. 409 once the
    round reported any output (a norm, a trial): then it may only be committed."""
    caller.require(Role.silo, *SETTLERS)
    scope = caller.silo_scope(also=SETTLERS)
    return _settled(charges.release(db, charge_id=charge_id, silo_scope=scope, key_id=caller.key_id), signer)
