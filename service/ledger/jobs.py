"""Training jobs, the norms their silos report, and the privacy levels of the menu.

The coordinator's path (`round_norms`) reads only norm reports: no budget, no ε, no history, so its
answers are the same whatever budgets the silos hold (paper 001: budgets are never exposed).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dpledger.service.ledger.errors import Conflict, InvalidRequest, NotFound
from dpledger.service.ledger.models import Job, JobSilo, NormReport, PrivacyLevel, Silo


def create_job(session: Session, *, name: str, silo_ids: list[int]) -> Job:
    if len(set(silo_ids)) != len(silo_ids):
        raise InvalidRequest("silo_ids", "must not repeat a silo")
    known = set(session.scalars(select(Silo.id).where(Silo.id.in_(silo_ids))))
    missing = [s for s in silo_ids if s not in known]
    if missing:
        raise InvalidRequest("silo_ids", f"unknown silos {missing}")
    job = Job(name=name, created_at=datetime.now(UTC))
    session.add(job)
    session.flush()
    session.add_all(JobSilo(job_id=job.id, silo_id=s) for s in silo_ids)
    session.commit()
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def report_norm(session: Session, *, job_id: int, round: int, silo_id: int, l2_norm: float) -> NormReport:
    """One report per silo and round; repeating the same value is a harmless retry."""
    get_job(session, job_id)
    if session.get(JobSilo, (job_id, silo_id)) is None:
        raise InvalidRequest("silo_id", f"silo {silo_id} is not part of job {job_id}")
    earlier = _report(session, job_id, round, silo_id)
    if earlier is not None:
        return _same_or_conflict(earlier, l2_norm)
    report = NormReport(job_id=job_id, round=round, silo_id=silo_id, l2_norm=l2_norm, created_at=datetime.now(UTC))
    session.add(report)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()  # a concurrent retry landed first
        earlier = _report(session, job_id, round, silo_id)
        assert earlier is not None
        return _same_or_conflict(earlier, l2_norm)
    return report


def _report(session: Session, job_id: int, round: int, silo_id: int) -> NormReport | None:
    return session.scalars(
        select(NormReport).where(NormReport.job_id == job_id, NormReport.round == round, NormReport.silo_id == silo_id)
    ).one_or_none()


def _same_or_conflict(earlier: NormReport, l2_norm: float) -> NormReport:
    if earlier.l2_norm != l2_norm:
        raise Conflict(f"silo {earlier.silo_id} already reported {earlier.l2_norm!r} for round {earlier.round}")
    return earlier


def round_norms(session: Session, *, job_id: int, round: int) -> dict[int, float]:
    get_job(session, job_id)
    rows = session.execute(
        select(NormReport.silo_id, NormReport.l2_norm).where(NormReport.job_id == job_id, NormReport.round == round)
    )
    return {silo_id: norm for silo_id, norm in rows}


def publish_level(session: Session, *, name: str, epsilon: float, delta: float) -> PrivacyLevel:
    level = PrivacyLevel(name=name, epsilon=epsilon, delta=delta, created_at=datetime.now(UTC))
    session.add(level)
    try:
        session.commit()
    except IntegrityError as error:
        session.rollback()
        raise Conflict(f"a privacy level named {name!r} exists already") from error
    return level


def list_levels(session: Session) -> list[PrivacyLevel]:
    return list(session.scalars(select(PrivacyLevel).order_by(PrivacyLevel.epsilon)))


def level_by_name(session: Session, name: str) -> PrivacyLevel:
    level = session.scalars(select(PrivacyLevel).where(PrivacyLevel.name == name)).one_or_none()
    if level is None:
        raise InvalidRequest("level", f"no privacy level named {name!r}")
    return level
