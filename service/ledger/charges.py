"""Reserve, commit, release: the safety invariant lives here.

For every silo, in every state any interleaving of requests, retries and crashes can produce:
ε_RDP(committed + reserved; δ_k) ≤ ε_k. So the check and the write share one transaction with the
silo row locked (DESIGN.md), and it is shaped like dp-accounting's compose(): check, then append.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dpledger.service.accounting import rdp
from dpledger.service.accounting.events import MechanismError, resolve
from dpledger.service.accounting.running_sum import (
    RunningSum,
    curve_from_json,
    curve_to_json,
)
from dpledger.service.ledger import silos, transparency
from dpledger.service.ledger.db import write_transaction
from dpledger.service.ledger.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    OverBudget,
    SettledAlready,
)
from dpledger.service.ledger.models import (
    Charge,
    ChargeStatus,
    EntryEvent,
    LedgerEntry,
    Search,
)
from dpledger.wire.mechanisms import AnyMechanism


@dataclass(frozen=True)
class Reservation:
    charge_id: int
    epsilon_spent: float
    epsilon_remaining: float
    replayed: bool
    position: transparency.Position  # the reserve entry's place in the transparency log (the receipt)


@dataclass(frozen=True)
class Settlement:
    charge_id: int
    status: ChargeStatus
    epsilon_spent: float
    position: transparency.Position


def request_hash(*, mechanism: AnyMechanism, job_id: str | None, round: int | None) -> str:
    body = {"mechanism": mechanism.model_dump(mode="json"), "job_id": job_id, "round": round}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def prepare(session: Session, silo_id: int, mechanism: AnyMechanism) -> tuple[AnyMechanism, np.ndarray]:
    """Resolves q against the silo's registered size and computes the curve, outside any lock:
    a new (q, σ) pair costs dp-accounting tens of milliseconds."""
    silo = silos.get(session, silo_id)
    try:
        resolved = resolve(mechanism, dataset_size=silo.dataset_size)
        return resolved, rdp.rdp_curve(resolved)
    except MechanismError as error:
        raise InvalidRequest(error.field, error.message) from error


def reserve(
    factory: sessionmaker[Session],
    *,
    silo_id: int,
    mechanism: AnyMechanism,
    idempotency_key: str,
    job_id: str | None = None,
    round: int | None = None,
) -> Reservation:
    digest = request_hash(mechanism=mechanism, job_id=job_id, round=round)
    with factory() as session:
        resolved, curve = prepare(session, silo_id, mechanism)
    # Encoded before the write lock: every writer of the database queues for the time it is held.
    mechanism_json, curve_json = resolved.model_dump_json(), curve_to_json(curve)

    with write_transaction(factory) as session:
        silo = silos.lock(session, silo_id)
        earlier = session.scalars(
            select(Charge).where(Charge.silo_id == silo_id, Charge.idempotency_key == idempotency_key)
        ).one_or_none()
        if earlier is not None:
            if earlier.request_hash != digest:
                raise InvalidRequest("idempotency_key", "was already used for a different request to this silo")
            return Reservation(
                earlier.id, earlier.epsilon_spent_after, max(0.0, silo.epsilon - earlier.epsilon_spent_after), True,
                _reserve_position(session, earlier.id),
            )

        spent = RunningSum.from_json(silo.rdp_spent)
        candidate = spent.add(curve)
        eps_candidate, _ = rdp.epsilon(candidate.curve(), delta=silo.delta)
        if not rdp.within_budget(eps_candidate, budget=silo.epsilon):
            eps_now, _ = rdp.epsilon(spent.curve(), delta=silo.delta)
            raise OverBudget(budget=silo.epsilon, epsilon_spent=eps_now, epsilon_if_approved=eps_candidate)

        now = datetime.now(UTC)
        charge = Charge(
            silo_id=silo_id, idempotency_key=idempotency_key, request_hash=digest,
            mechanism=mechanism_json, rdp=curve_json, order_grid=rdp.ORDER_GRID_ID,
            conversion=rdp.CONVERSION_ID, status=ChargeStatus.reserved, job_id=job_id, round=round,
            epsilon_spent_after=eps_candidate, created_at=now,
        )
        session.add(charge)
        session.flush()
        silo.rdp_spent = candidate.to_json()
        position = silos.append_entry(
            session, silo, event=EntryEvent.reserve, charge=charge, epsilon_spent=eps_candidate, now=now
        )
        return Reservation(charge.id, eps_candidate, max(0.0, silo.epsilon - eps_candidate), False, position)


def _reserve_position(session: Session, charge_id: int) -> transparency.Position:
    entry = session.scalars(
        select(LedgerEntry).where(LedgerEntry.charge_id == charge_id, LedgerEntry.event == EntryEvent.reserve)
    ).one()
    return transparency.position_of(session, entry)


def silo_of_charge(session: Session, charge_id: int) -> int:
    charge = session.get(Charge, charge_id)
    if charge is None:
        raise NotFound(f"charge {charge_id} not found")
    return charge.silo_id


def commit(factory: sessionmaker[Session], *, charge_id: int) -> Settlement:
    """The round ran: the reservation becomes a committed charge (ε_spent is unchanged)."""
    return _settle(factory, charge_id=charge_id, event=EntryEvent.commit)


def release(factory: sessionmaker[Session], *, charge_id: int) -> Settlement:
    """The worker declares it never touched the data: the reservation's curve is returned."""
    return _settle(factory, charge_id=charge_id, event=EntryEvent.release)


def _settle(factory: sessionmaker[Session], *, charge_id: int, event: EntryEvent) -> Settlement:
    with factory() as session:
        silo_id = silo_of_charge(session, charge_id)
    with write_transaction(factory) as session:
        silo = silos.lock(session, silo_id)
        charge = session.get(Charge, charge_id)
        assert charge is not None  # charges are never deleted
        if charge.status != ChargeStatus.reserved:
            raise SettledAlready(charge_id, ChargeStatus(charge.status).value)
        if event is EntryEvent.release and session.scalars(select(Search.id).where(Search.charge_id == charge_id)).first():
            # A search's trials query the data as soon as K is known: its charge settles only by
            # reporting them, never by a release that would hand the budget back.
            raise Conflict(f"charge {charge_id} pays for a hyperparameter search; it is committed by the search's last trial")
        curve = curve_from_json(charge.rdp)
        if event is EntryEvent.commit:
            charge.status = ChargeStatus.committed
            silo.rdp_committed = RunningSum.from_json(silo.rdp_committed).add(curve).to_json()
        else:
            charge.status = ChargeStatus.released
            silo.rdp_spent = RunningSum.from_json(silo.rdp_spent).subtract(curve).to_json()
        eps = silos.epsilon_spent(silo)
        position = silos.append_entry(session, silo, event=event, charge=charge, epsilon_spent=eps, now=datetime.now(UTC))
        return Settlement(charge_id, ChargeStatus(charge.status), eps, position)


@dataclass(frozen=True)
class HistoryRow:
    entry: LedgerEntry
    charge: Charge | None


def history(session: Session, silo_id: int, *, after_seq: int = 0, limit: int = 10_000) -> list[HistoryRow]:
    silos.get(session, silo_id)
    rows = session.execute(
        select(LedgerEntry, Charge)
        .outerjoin(Charge, Charge.id == LedgerEntry.charge_id)
        .where(LedgerEntry.silo_id == silo_id, LedgerEntry.seq > after_seq)
        .order_by(LedgerEntry.seq)
        .limit(limit)
    ).all()
    return [HistoryRow(entry, charge) for entry, charge in rows]
