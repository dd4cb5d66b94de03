"""The reads of the ledger's plain records: jobs and their norm reports, the privacy levels of the
menu, API keys by hash, searches by charge, and the rows a silo's history and the audit replay.

Each function takes the caller's session and runs its statements in it; none commits. What they
return is ORM objects or plain values; a result that a caller walks row by row is handed back as it
comes from the session (executed here, read there), so nothing is buffered that was not before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from dpledger.service.store.models import (
    ApiKey,
    Charge,
    EntryEvent,
    LedgerEntry,
    NormReport,
    PrivacyLevel,
    Role,
    Search,
    Silo,
)

# Silos


def known_silo_ids(session: Session, silo_ids: Sequence[int]) -> set[int]:
    """Which of `silo_ids` name registered silos."""
    return set(session.scalars(select(Silo.id).where(Silo.id.in_(silo_ids))))


# Jobs and norm reports


def norm_report(session: Session, *, job_id: int, round: int, silo_id: int) -> NormReport | None:
    """The silo's norm report for this job and round, if it made one."""
    return session.scalars(
        select(NormReport).where(NormReport.job_id == job_id, NormReport.round == round, NormReport.silo_id == silo_id)
    ).one_or_none()


def round_norms(session: Session, *, job_id: int, round: int) -> dict[int, float]:
    """The norms reported for one round of a job, by silo id."""
    rows = session.execute(
        select(NormReport.silo_id, NormReport.l2_norm).where(NormReport.job_id == job_id, NormReport.round == round)
    )
    return {silo_id: norm for silo_id, norm in rows}


# Privacy levels


def privacy_levels(session: Session) -> list[PrivacyLevel]:
    """The menu's privacy levels, the smallest ε first."""
    return list(session.scalars(select(PrivacyLevel).order_by(PrivacyLevel.epsilon)))


def privacy_level(session: Session, name: str) -> PrivacyLevel | None:
    return session.scalars(select(PrivacyLevel).where(PrivacyLevel.name == name)).one_or_none()


# API keys


def key_by_hash(session: Session, key_hash: str) -> ApiKey | None:
    """The key stored under this SHA-256, revoked or not."""
    return session.scalars(select(ApiKey).where(ApiKey.key_hash == key_hash)).one_or_none()


def live_admin_key_id(session: Session) -> int | None:
    """Some admin key that is not revoked, if there is one (`dpledger init` makes the first)."""
    return session.scalars(select(ApiKey.id).where(ApiKey.role == Role.admin, ApiKey.revoked_at.is_(None))).first()


# Searches


def search_by_charge(session: Session, charge_id: int) -> Search | None:
    return session.scalars(select(Search).where(Search.charge_id == charge_id)).one_or_none()


# A silo's history


def reserve_release_curves(session: Session, silo_id: int, *, through_seq: int) -> Iterable[tuple[EntryEvent, str | None]]:
    """(event, curve) of the silo's reserve and release entries up to `through_seq`, in order: one light
    row each, what replaying the RDP sum before a page of history needs."""
    return session.execute(
        select(LedgerEntry.event, Charge.rdp)
        .join(Charge, Charge.id == LedgerEntry.charge_id)
        .where(LedgerEntry.silo_id == silo_id, LedgerEntry.seq <= through_seq,
               LedgerEntry.event.in_((EntryEvent.reserve, EntryEvent.release)))
        .order_by(LedgerEntry.seq)
    ).tuples()


def entries_after(
    session: Session, silo_id: int, *, after_seq: int, limit: int
) -> Sequence[tuple[LedgerEntry, Charge | None]]:
    """At most `limit` of the silo's entries after `after_seq`, in order, each with its charge (None
    for an entry about the silo's record)."""
    return session.execute(
        select(LedgerEntry, Charge)
        .outerjoin(Charge, Charge.id == LedgerEntry.charge_id)
        .where(LedgerEntry.silo_id == silo_id, LedgerEntry.seq > after_seq)
        .order_by(LedgerEntry.seq)
        .limit(limit)
    ).tuples().all()


# The audit


def silos_in_order(session: Session, silo_ids: Sequence[int] | None = None) -> Iterable[Silo]:
    """The silos by id: all of them, or those of `silo_ids`."""
    query = select(Silo).order_by(Silo.id)
    if silo_ids is not None:
        query = query.where(Silo.id.in_(silo_ids))
    return session.scalars(query)


def charges_of(session: Session, silo_id: int) -> Iterable[Charge]:
    """The silo's charges, in no particular order."""
    return session.scalars(select(Charge).where(Charge.silo_id == silo_id))


def entries_of(session: Session, silo_id: int) -> Iterable[LedgerEntry]:
    """The silo's entries, in order."""
    return session.scalars(select(LedgerEntry).where(LedgerEntry.silo_id == silo_id).order_by(LedgerEntry.seq))
