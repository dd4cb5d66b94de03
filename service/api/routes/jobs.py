"""Jobs, the norms of noisy updates, and privacy groups: the coordinator's side, budget-blind."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from dpledger.service.accounting.clustering import cluster_norms
from dpledger.service.api.deps import DbDep, IdPath, PrincipalDep
from dpledger.service.ledger import jobs
from dpledger.service.store.models import Role
from dpledger.wire.schemas import (
    GroupComponent,
    GroupsResponse,
    JobCreated,
    JobCreateRequest,
    Level,
    LevelCreateRequest,
    NormReported,
    NormReportRequest,
)

router = APIRouter(prefix="/v1", tags=["jobs"])
Round = Annotated[int, Path(ge=0, le=10**9)]


@router.post("/jobs", status_code=status.HTTP_201_CREATED, response_model=JobCreated, name="create_job")
def create_job(body: JobCreateRequest, caller: PrincipalDep, db: DbDep) -> JobCreated:
    caller.require(Role.admin, Role.coordinator)
    job = jobs.create_job(db, name=body.name, silo_ids=body.silo_ids)
    return JobCreated(job_id=job.id)


@router.post(
    "/jobs/{job_id}/rounds/{round}/norms", status_code=status.HTTP_201_CREATED, response_model=NormReported,
    name="report_norm",
)
def report_norm(job_id: IdPath, round: Round, body: NormReportRequest, caller: PrincipalDep, db: DbDep) -> NormReported:
    caller.require_silo(body.silo_id)
    report = jobs.report_norm(
        db, job_id=job_id, round=round, silo_id=body.silo_id, l2_norm=body.l2_norm, charge_id=body.charge_id,
        key_id=caller.key_id,
    )
    return NormReported(job_id=job_id, round=round, silo_id=report.silo_id, l2_norm=report.l2_norm)


@router.get("/jobs/{job_id}/rounds/{round}/groups", response_model=GroupsResponse, name="round_groups")
def round_groups(job_id: IdPath, round: Round, caller: PrincipalDep, db: DbDep) -> GroupsResponse:
    """A Gaussian mixture over the round's reported norms (1–3 components by BIC, fixed seed);
    groups numbered by increasing mean norm. Reads no budget (Liu et al. 2023)."""
    caller.require(Role.coordinator, Role.admin, Role.auditor)
    norms = jobs.round_norms(db, job_id=job_id, round=round)
    if not norms:
        return GroupsResponse(groups={}, components=[], n_components=0)  # nobody reported yet
    grouping = cluster_norms(norms)
    return GroupsResponse(
        groups=grouping.groups,
        components=[GroupComponent(mean_norm=c.mean_norm, std_norm=c.std_norm, size=c.size) for c in grouping.components],
        n_components=grouping.n_components,
    )


@router.post("/levels", status_code=status.HTTP_201_CREATED, response_model=Level, name="publish_level")
def publish_level(body: LevelCreateRequest, caller: PrincipalDep, db: DbDep) -> Level:
    caller.require(Role.admin)
    level = jobs.publish_level(db, name=body.name, epsilon=body.epsilon, delta=body.delta)
    return Level(name=level.name, epsilon=level.epsilon, delta=level.delta)


@router.get("/levels", response_model=list[Level], name="list_levels")
def list_levels(caller: PrincipalDep, db: DbDep) -> list[Level]:
    """The menu is public to every key: a level is an offer, not any silo's budget."""
    return [Level(name=lv.name, epsilon=lv.epsilon, delta=lv.delta) for lv in jobs.list_levels(db)]
