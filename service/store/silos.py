"""Reads of silo rows outside the approval's lock (store/reserving.py holds the lock)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from dpledger.service.store.models import Charge, Silo


def all_silos(session: Session) -> list[Silo]:
    return list(session.scalars(select(Silo).order_by(Silo.id)))


def by_name(session: Session, name: str) -> Silo | None:
    return session.scalars(select(Silo).where(Silo.name == name)).one_or_none()


def holds_charges(session: Session, silo_id: int) -> bool:
    return session.scalars(select(Charge.id).where(Charge.silo_id == silo_id).limit(1)).first() is not None
