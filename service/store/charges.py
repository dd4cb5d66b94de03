"""Reads of charges and their entries outside the approval's statements (store/reserving.py)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from dpledger.service.store.models import Charge, ChargeStatus, EntryEvent, LedgerEntry, Search


def reserve_entry(session: Session, charge_id: int) -> LedgerEntry | None:
    """The entry that reserved the charge (its hash covers the charge as reserved)."""
    return session.scalars(select(LedgerEntry).where(
        LedgerEntry.charge_id == charge_id, LedgerEntry.event == EntryEvent.reserve)).first()


def of_silo(session: Session, silo_id: int, *, status: ChargeStatus | None, job_id: str | None,
            limit: int) -> Iterable[Charge]:
    """The silo's charges in id order, of this status and job where given."""
    query = select(Charge).where(Charge.silo_id == silo_id)
    if status is not None:
        query = query.where(Charge.status == status)
    if job_id is not None:
        query = query.where(Charge.job_id == job_id)
    return session.scalars(query.order_by(Charge.id).limit(limit))


def pays_for_search(session: Session, charge_id: int) -> bool:
    return session.scalars(select(Search.id).where(Search.charge_id == charge_id)).first() is not None


def reserved_untouched(session: Session, *, silo_id: int, round: int) -> Iterable[Charge]:
    """The silo's charges of `round` still reserved and not yet marked as having touched the data."""
    return session.scalars(select(Charge).where(
        Charge.silo_id == silo_id, Charge.round == round, Charge.status == ChargeStatus.reserved,
        Charge.touched_at.is_(None),
    ))
