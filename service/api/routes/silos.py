"""Silos: registration, budgets, ε history."""

from __future__ import annotations

import csv
import io
import json
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Query, status
from fastapi.responses import Response

from dpledger.service.accounting import cost, plans, rdp
from dpledger.service.accounting.events import resolve
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.api.admission import TOO_MANY, AdmittedDep
from dpledger.service.api.deps import READERS, DbDep, IdPath, PrincipalDep
from dpledger.service.ledger import charges, gate, jobs, seals, silos
from dpledger.service.ledger import history as ledger_history
from dpledger.service.ledger.errors import InvalidRequest
from dpledger.service.store.models import EntryEvent, Role, Silo
from dpledger.wire.mechanisms import DpSgd
from dpledger.wire.safe_text import safe_cell
from dpledger.wire.schemas import (
    FilterView,
    HistoryEntry,
    OverBudgetResponse,
    PlanRequest,
    PlanView,
    SiloCalibrateRequest,
    SiloCalibration,
    SiloCreated,
    SiloCreateRequest,
    SiloDetail,
    SiloRetireRequest,
    SiloSummary,
    delta_refusal,
    finite_or_none,
)

router = APIRouter(prefix="/v1/silos", tags=["silos"])


def _summary(silo: Silo) -> SiloSummary:
    return SiloSummary(
        id=silo.id, name=silo.name, epsilon=silo.epsilon, delta=silo.delta, dataset_size=silo.dataset_size,
        relation=silo.relation, epsilon_spent=finite_or_none(silos.epsilon_spent(silo)),
        epsilon_dp_accounting=finite_or_none(charges.spent_reference(silo)), retired_seq=silo.retired_seq,
        retired_reason=silo.retired_reason,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SiloCreated, name="create_silo", responses=TOO_MANY)
def create_silo(body: SiloCreateRequest, caller: AdmittedDep, db: DbDep) -> SiloCreated:
    caller.require(Role.admin)
    epsilon, delta = body.epsilon, body.delta
    if body.level is not None:
        level = jobs.level_by_name(db, body.level)
        epsilon, delta = level.epsilon, level.delta
    assert epsilon is not None and delta is not None  # the request model guarantees one or the other
    refused = delta_refusal(delta, body.dataset_size)
    if refused is not None:  # a level's δ too: the menu's entry may suit larger silos than this one
        raise InvalidRequest("delta" if body.level is None else "level", refused)
    with cost.guard("horizon"):
        if body.horizon is not None:  # priced before its curve is computed, as a charge is (cost.py)
            cost.check(resolve(body.horizon, dataset_size=body.dataset_size, path="horizon"), path="horizon")
        silo, api_key = silos.register(
            db, name=body.name, epsilon=epsilon, delta=delta, dataset_size=body.dataset_size, relation=body.relation,
            horizon=body.horizon,
        )
    return SiloCreated(
        id=silo.id, name=silo.name, epsilon=silo.epsilon, delta=silo.delta, dataset_size=silo.dataset_size,
        relation=silo.relation, api_key=api_key,
    )


@router.get("", response_model=list[SiloSummary], name="list_silos")
def list_silos(caller: PrincipalDep, db: DbDep) -> list[SiloSummary]:
    caller.require(*READERS)
    with db.read() as session:
        found = silos.list_all(session)
        for silo in found:  # an edited record is named (seals.Tampered), never read as if it were sound
            seals.check(session, silo)
        return [_summary(s) for s in found]


@router.get("/{silo_id}", response_model=SiloDetail, name="get_silo")
def get_silo(silo_id: IdPath, caller: PrincipalDep, db: DbDep) -> SiloDetail:
    caller.require_silo(silo_id, also=READERS)
    with db.read() as session:
        silo = silos.get(session, silo_id)
    budget = silos.status(silo)
    return SiloDetail(
        **_summary(silo).model_dump(exclude={"epsilon_spent", "epsilon_dp_accounting"}),
        epsilon_spent=finite_or_none(budget.epsilon_spent),
        epsilon_dp_accounting=finite_or_none(ledger_history.dp_accounting_epsilon(silo)),
        epsilon_committed=finite_or_none(budget.epsilon_committed),
        epsilon_remaining=budget.epsilon_remaining,
        rho=budget.rho,
        order=budget.order,
        filter=_filter_view(silo),
        plan=_plan_view(silo),
        gated_on=gate.gated_on(silo),
    )


def _filter_view(silo: Silo) -> FilterView | None:
    if gate.pending(silo):
        return None  # fixed by the silo's first charge (gate.pending)
    spec = gate.spec(silo)
    return FilterView(orders=list(spec.orders), weights=list(spec.weights), source=spec.source, parts=list(spec.parts))


def _plan_view(silo: Silo) -> PlanView | None:
    declared = gate.plan(silo)
    if declared is None:
        return None
    return PlanView(
        mechanism=json.loads(declared.mechanism), epsilon=declared.epsilon, units=declared.units,
        units_used=silo.plan_used, after=declared.after, delta_share=declared.delta_share, ended_at_seq=silo.plan_ended_seq,
    )


@router.post(
    "/{silo_id}/plan",
    status_code=status.HTTP_201_CREATED,
    response_model=PlanView,
    name="declare_plan",
    responses={**TOO_MANY, 409: {"model": OverBudgetResponse, "description": "the plan's ε exceeds the budget, or the "
                                 "silo holds charges or a plan already: nothing was written"}},
)
def declare_plan(silo_id: IdPath, body: PlanRequest, caller: AdmittedDep, db: DbDep) -> PlanView:
    """Fixes the silo's one plan before its first charge, priced by its PLD ε on its share of δ:
    while every charge follows it, in order, the gate reads the lower of that ε and the filter's
    (on the rest of δ); stopping early is free, and a charge off the plan ends the plan's branch
    (the filter alone from then on), never the silo."""
    caller.require_silo(silo_id, also=(Role.admin,))
    with db.read() as session:  # a plan's q is the service's, as a charge's: a declared sampling_rate is refused
        resolved = resolve(body.mechanism, dataset_size=silos.get(session, silo_id).dataset_size, charged=True)
    with cost.guard("mechanism"):  # its PLD priced before it runs, and stopped where it outruns that (plans.py)
        too_costly = cost.check(resolved, pld_discretization=plans.PLAN_DISCRETIZATION, warm=False)
        if too_costly is not None:  # before the plan is cut into units: a 422 at once
            raise InvalidRequest("mechanism", f"cannot be priced as a plan within one request's bounded work: {too_costly}")
        silos.declare_plan(db, silo_id=silo_id, mechanism=body.mechanism)
    with db.read() as session:
        silo = silos.get(session, silo_id)
    view = _plan_view(silo)
    assert view is not None  # just declared
    return view


def _subject(event: str, silo: Silo) -> dict[str, object] | None:
    try:
        if event == EntryEvent.seal:
            return {"filter": json.loads(silo.filter_spec), "plan": None if silo.plan is None else json.loads(silo.plan),
                    "epsilon": silo.epsilon, "delta": silo.delta, "dataset_size": silo.dataset_size}
        if event == EntryEvent.filter or (event == EntryEvent.create and silo.filter_seq == 1):
            return {"filter": json.loads(silo.filter_spec)}
        if event == EntryEvent.plan and silo.plan is not None:
            return {"plan": json.loads(silo.plan)}
        if event == EntryEvent.retire:
            return {"reason": silo.retired_reason}
    except ValueError:  # an edited row: shown as missing here, and named by /v1/audit/verify
        return None
    return None


@router.post(
    "/{silo_id}/seal",
    response_model=SiloDetail,
    name="seal_silo",
    responses={409: {"description": "the record matches its entries (nothing to seal), or cannot be read as it stands "
                     "(restore the row instead): nothing was written"}},
)
def seal_silo(silo_id: IdPath, caller: PrincipalDep, db: DbDep) -> SiloDetail:
    """Admin only, after inspecting a silo refused as tampered (GET /v1/audit/verify, its history):
    accepts its record as it stands in a `seal` entry of its chain and of the transparency log, so that
    approvals resume. The edit stays visible: the create entry's leaf no longer matches its record."""
    caller.require(Role.admin)
    seals.seal(db, silo_id)
    return get_silo(silo_id, caller, db)


@router.post(
    "/{silo_id}/retire",
    response_model=SiloDetail,
    name="retire_silo",
    responses={409: {"description": "the silo is retired already, or its record is tampered (restore or seal it "
                     "first): nothing was written"}},
)
def retire_silo(silo_id: IdPath, body: SiloRetireRequest, caller: PrincipalDep, db: DbDep) -> SiloDetail:
    """Admin only: retires a silo registered wrongly (its dataset size, its budget), for good, in a `retire`
    entry of its chain and of the transparency log covering its identity and the reason. From then on every
    approval on it (a charge, a search, a plan, a σ calibration) is refused with a 409 quoting the reason;
    reservations made before are still committed or released, and everything stays readable. Nothing is
    refunded or hidden, and its name stays its own: register the corrected silo under another name."""
    caller.require(Role.admin)
    silos.retire(db, silo_id, reason=body.reason)
    return get_silo(silo_id, caller, db)


@router.post("/{silo_id}/calibrate", response_model=SiloCalibration, name="calibrate_silo", responses=TOO_MANY)
def calibrate_silo(silo_id: IdPath, body: SiloCalibrateRequest, caller: AdmittedDep, db: DbDep) -> SiloCalibration:
    """The noise multiplier that lets `rounds` more rounds of DP-SGD fit what this silo has LEFT.

    Only the silo's own key and admins: the answer is a function of the silo's budget, which the
    coordinator (and auditors' dashboards aside) must not learn. q is batch_size over the registered
    dataset_size, as the charge will be; nothing is reserved."""
    caller.require_silo(silo_id, also=(Role.admin,))
    with db.read() as session:
        silo = silos.get(session, silo_id)
    # A round per charge: on a silo registered without a horizon, its first round fixes the filter.
    with cost.guard("rounds"):
        plan = silos.plan_noise(silo, batch_size=body.batch_size, steps=body.rounds * body.steps_per_round,
                                first_steps=body.steps_per_round)
    # Beside the gate's readings, dp-accounting's reference of the same charges: spent, and spent + the rounds.
    spent = RunningSum.from_json(silo.rdp_spent).curve()
    planned = rdp.certified_curve(DpSgd(sampling_rate=plan.sampling_rate, noise_multiplier=plan.noise_multiplier,
                                        steps=body.rounds * body.steps_per_round))
    references = rdp.epsilons(np.vstack([spent, spent + planned]), delta=silo.delta)
    return SiloCalibration(
        noise_multiplier=plan.noise_multiplier, sampling_rate=plan.sampling_rate, rounds=body.rounds,
        steps_per_round=body.steps_per_round, epsilon_spent=finite_or_none(silos.epsilon_spent(silo)),
        epsilon_spent_dp_accounting=finite_or_none(float(references[0])), epsilon_after=plan.epsilon_after,
        epsilon_after_dp_accounting=finite_or_none(float(references[1])), epsilon=silo.epsilon,
    )


CSV_COLUMNS = [
    "seq", "charge_id", "event", "mechanism", "job_id", "round", "epsilon_spent", "epsilon_dp_accounting", "created_at",
    "prev_hash", "hash",
]


@router.get(
    "/{silo_id}/history",
    response_model=list[HistoryEntry],
    name="silo_history",
    responses={200: {"content": {"text/csv": {}}, "description": "JSON list, or CSV with ?format=csv"}},
)
def silo_history(
    silo_id: IdPath,
    caller: PrincipalDep,
    db: DbDep,
    format: Literal["json", "csv"] = "json",
    after_seq: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[HistoryEntry] | Response:
    caller.require_silo(silo_id, also=READERS)
    with db.read() as session:
        rows = ledger_history.history(session, silo_id, after_seq=after_seq, limit=limit)
        silo = silos.get(session, silo_id, checked=False)  # the history is what an admin inspects a tampered silo by
    entries = [
        HistoryEntry(
            seq=r.entry.seq,
            charge_id=r.entry.charge_id,
            event=r.entry.event,
            mechanism=None if r.charge is None else json.loads(r.charge.mechanism),
            subject=_subject(r.entry.event, silo) if r.charge is None else None,
            job_id=None if r.charge is None else r.charge.job_id,
            round=None if r.charge is None else r.charge.round,
            epsilon_spent=finite_or_none(r.entry.epsilon_spent),
            epsilon_dp_accounting=None if r.epsilon_dp_accounting is None else finite_or_none(r.epsilon_dp_accounting),
            created_at=r.entry.created_at,
            prev_hash=r.entry.prev_hash,
            hash=r.entry.hash,
        )
        for r in rows
    ]
    if format == "json":
        return entries
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for e in entries:
        row = e.model_dump(mode="json", exclude={"subject"})
        row["mechanism"] = "" if e.mechanism is None else json.dumps(e.mechanism, sort_keys=True)
        # A silo chooses its job ids: an auditor's spreadsheet must not run them as formulas.
        writer.writerow({k: safe_cell(v) if isinstance(v, str) else v for k, v in row.items()})
    return Response(out.getvalue(), media_type="text/csv")
