"""Training jobs, the norms their silos report, and the privacy levels of the menu.

The coordinator's path (`round_norms`) reads only norm reports: no budget, no ε, no history, so its
answers are the same whatever budgets the silos hold (Liu et al. 2023: budgets are never exposed).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dpledger.service.ledger import charges, keys, silos
from dpledger.service.ledger.errors import Conflict, InvalidRequest, NotFound
from dpledger.service.store import records
from dpledger.service.store.db import Database
from dpledger.service.store.models import Job, JobSilo, NormReport, PrivacyLevel


def create_job(db: Database, *, name: str, silo_ids: list[int]) -> Job:
    if len(set(silo_ids)) != len(silo_ids):
        raise InvalidRequest("silo_ids", "must not repeat a silo")
    with db.write() as session:
        known = records.known_silo_ids(session, silo_ids)
        if len(known) != len(silo_ids):
            # Which ids exist is not said: the coordinator, who creates jobs, may not learn it.
            raise InvalidRequest("silo_ids", "must all name registered silos")
        job = Job(name=name, created_at=datetime.now(UTC))
        session.add(job)
        session.flush()
        session.add_all(JobSilo(job_id=job.id, silo_id=s) for s in silo_ids)
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def report_norm(
    db: Database, *, job_id: int, round: int, silo_id: int, l2_norm: float, charge_id: int | None = None,
    key_id: int | None = None,
) -> NormReport:
    """One report per silo and round; repeating the same value is a harmless retry. The round ran,
    so its charges may no longer be released (`charges.mark_touched`)."""
    with db.write() as session:
        keys.require_live(session, key_id)
        get_job(session, job_id)
        if session.get(JobSilo, (job_id, silo_id)) is None:
            raise NotFound(f"job {job_id} not found")  # a job the silo is not part of is not its to see
        silos.lock(session, silo_id)
        charges.mark_touched(session, silo_id=silo_id, charge_id=charge_id, round=round)
        earlier = records.norm_report(session, job_id=job_id, round=round, silo_id=silo_id)
        if earlier is not None:
            return _same_or_conflict(earlier, l2_norm)
        report = NormReport(job_id=job_id, round=round, silo_id=silo_id, l2_norm=l2_norm, created_at=datetime.now(UTC))
        session.add(report)
        return report


def _same_or_conflict(earlier: NormReport, l2_norm: float) -> NormReport:
    if earlier.l2_norm != l2_norm:
        raise Conflict(f"silo {earlier.silo_id} already reported {earlier.l2_norm!r} for round {earlier.round}")
    return earlier


def round_norms(db: Database, *, job_id: int, round: int) -> dict[int, float]:
    with db.read() as session:
        get_job(session, job_id)
        return records.round_norms(session, job_id=job_id, round=round)


def publish_level(db: Database, *, name: str, epsilon: float, delta: float) -> PrivacyLevel:
    try:
        with db.write() as session:
            level = PrivacyLevel(name=name, epsilon=epsilon, delta=delta, created_at=datetime.now(UTC))
            session.add(level)
    except IntegrityError as error:
        raise Conflict(f"a privacy level named {name!r} exists already") from error
    return level


def list_levels(db: Database) -> list[PrivacyLevel]:
    with db.read() as session:
        return records.privacy_levels(session)


def level_by_name(db: Database, name: str) -> PrivacyLevel:
    with db.read() as session:
        level = records.privacy_level(session, name)
    if level is None:
        raise InvalidRequest("level", f"no privacy level named {name!r}")
    return level
