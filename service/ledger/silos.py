"""Silos: registration (with the genesis entry of their chain) and their budget as it stands."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dpledger.service.accounting import rdp, reports
from dpledger.service.accounting.events import MechanismError
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger import chain, transparency
from dpledger.service.ledger.db import Database
from dpledger.service.ledger.errors import Conflict, InvalidRequest, NotFound
from dpledger.service.ledger.keys import create_key
from dpledger.service.ledger.models import Charge, EntryEvent, LedgerEntry, Role, Silo
from dpledger.wire.enums import Relation


@dataclass(frozen=True)
class BudgetStatus:
    epsilon_spent: float
    epsilon_committed: float
    epsilon_remaining: float
    rho: float | None
    order: float


def register(
    db: Database, *, name: str, epsilon: float, delta: float, dataset_size: int, relation: Relation = Relation.add_remove
) -> tuple[Silo, str]:
    """Creates the silo, its chain's genesis entry and its first key, in one transaction."""
    empty = RunningSum.empty(len(rdp.ORDERS)).to_json()
    now = datetime.now(UTC)
    try:
        with db.write() as session:
            silo = Silo(
                name=name, epsilon=epsilon, delta=delta, dataset_size=dataset_size, relation=relation,
                rdp_spent=empty, rdp_committed=empty, chain_seq=0, chain_head=chain.GENESIS, created_at=now,
            )
            session.add(silo)
            session.flush()
            append_entry(session, silo, event=EntryEvent.create, charge=None, epsilon_spent=0.0, now=now)
            _, raw = create_key(session, role=Role.silo, silo_id=silo.id)
    except IntegrityError as error:
        raise Conflict(f"a silo named {name!r} exists already") from error
    return silo, raw


def append_entry(
    session: Session, silo: Silo, *, event: EntryEvent, charge: Charge | None, epsilon_spent: float, now: datetime
) -> transparency.Position:
    """Appends one entry to the silo's chain and, in the same transaction, to the transparency log
    over all silos; the caller holds the silo's lock. Returns the entry's place in the log."""
    entry = LedgerEntry(
        silo_id=silo.id, seq=silo.chain_seq + 1, event=event, charge_id=None if charge is None else charge.id,
        epsilon_spent=epsilon_spent, created_at=now, prev_hash=silo.chain_head, hash="",
    )
    subject = chain.silo_fields(silo) if charge is None else chain.charge_fields(charge)
    entry.hash = chain.entry_hash(entry, subject=subject)
    session.add(entry)
    silo.chain_seq = entry.seq
    silo.chain_head = entry.hash
    # The leaf row names the entry's id; flushed after the silo's changes, so its row is written once.
    session.flush()
    return transparency.append(session, entry, subject=subject)


def get(session: Session, silo_id: int) -> Silo:
    silo = session.get(Silo, silo_id)
    if silo is None:
        raise NotFound(f"silo {silo_id} not found")
    return silo


def lock(session: Session, silo_id: int) -> Silo:
    """The silo row, locked until the transaction ends (FOR UPDATE; SQLite's IMMEDIATE lock already
    serialises writers)."""
    silo = session.scalars(select(Silo).where(Silo.id == silo_id).with_for_update()).one_or_none()
    if silo is None:
        raise NotFound(f"silo {silo_id} not found")
    return silo


def list_all(session: Session) -> list[Silo]:
    return list(session.scalars(select(Silo).order_by(Silo.id)))


def status(silo: Silo) -> BudgetStatus:
    spent = rdp.guarantee(RunningSum.from_json(silo.rdp_spent).curve(), delta=silo.delta)
    committed, _ = rdp.epsilon(RunningSum.from_json(silo.rdp_committed).curve(), delta=silo.delta)
    return BudgetStatus(
        epsilon_spent=spent.epsilon,
        epsilon_committed=committed,
        epsilon_remaining=max(0.0, silo.epsilon - spent.epsilon),
        rho=spent.rho,
        order=spent.order,
    )


def epsilon_spent(silo: Silo) -> float:
    return rdp.epsilon(RunningSum.from_json(silo.rdp_spent).curve(), delta=silo.delta)[0]


@dataclass(frozen=True)
class NoisePlan:
    noise_multiplier: float
    sampling_rate: float
    epsilon_after: float


def plan_noise(silo: Silo, *, batch_size: int, steps: int) -> NoisePlan:
    """The σ that lets `steps` more DP-SGD steps at q = batch_size / the registered dataset_size fit
    what the silo has left (reserved charges count as spent). Reserves nothing."""
    if silo.relation != Relation.add_remove:
        raise InvalidRequest(
            "silo_id", f"DP-SGD is analysed under add_remove; this silo is registered with relation={silo.relation}"
        )
    if batch_size > silo.dataset_size:
        raise InvalidRequest("batch_size", f"must be at most the silo's dataset_size={silo.dataset_size}. Found {batch_size}.")
    sampling_rate = batch_size / silo.dataset_size
    try:
        found = reports.calibrate_remaining(
            RunningSum.from_json(silo.rdp_spent).curve(), budget=silo.epsilon, delta=silo.delta,
            sampling_rate=sampling_rate, steps=steps,
        )
    except MechanismError as error:
        raise InvalidRequest(error.field, error.message) from error
    return NoisePlan(noise_multiplier=found.noise_multiplier, sampling_rate=sampling_rate, epsilon_after=found.epsilon_after)
