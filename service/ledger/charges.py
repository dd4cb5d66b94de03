"""Reserve, commit, release: the safety invariant lives here.

For every silo, in every state any interleaving of requests, retries and crashes can produce:
ε_gate(committed + reserved) ≤ ε_k (the silo's proven gate, ledger/gate.py). So the check and the
write share one transaction with the silo row locked (docs/ARCHITECTURE.md), and it is shaped like
dp-accounting's compose(): check, then append.

Exactly once: an idempotency key names one charge of its silo for good. A retry of the same
request is answered with that charge as it stands now (`replayed`, with its real status), never
with a second approval; a different request under the same key is refused, whatever became of the
charge (a released charge's key included). A charge whose round reported any output may only be
committed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from dpledger.service.accounting import cost, rdp
from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting.events import check_relation, resolve
from dpledger.service.accounting.running_sum import (
    RunningSum,
    curve_from_json,
    curve_to_json,
)
from dpledger.service.ledger import chain, gate, keys, seals, silos, transparency
from dpledger.service.ledger.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    OverBudget,
    SettledAlready,
    Unauthorized,
)
from dpledger.service.store import charges as store_charges
from dpledger.service.store import curves, reserving
from dpledger.service.store.db import Database
from dpledger.service.store.models import (
    Charge,
    ChargeRecord,
    ChargeStatus,
    EntryEvent,
    Silo,
    SiloRecord,
)
from dpledger.wire.enums import Relation
from dpledger.wire.mechanisms import AnyMechanism


@dataclass(frozen=True)
class ChargeView:
    """A charge as it stands, with its silo's ε now: what a reservation, a replay and a read answer."""

    charge: Charge | ChargeRecord  # a record where this answer inserted it
    epsilon: float  # the charge's own ε at the silo's δ
    epsilon_spent: float  # the silo's, reserved + committed
    epsilon_remaining: float
    replayed: bool
    position: transparency.Position  # the reserve entry's place in the transparency log (the receipt)
    epsilon_dp_accounting: float  # for reference: dp-accounting's non-adaptive RDP ε of the silo's same charges

    @property
    def charge_id(self) -> int:
        return self.charge.id

    @property
    def status(self) -> ChargeStatus:
        return ChargeStatus(self.charge.status)


@dataclass(frozen=True)
class Settlement:
    charge_id: int
    status: ChargeStatus
    epsilon_spent: float
    position: transparency.Position
    epsilon_dp_accounting: float  # for reference, beside epsilon_spent (as ChargeView's)


@dataclass(frozen=True)
class Priced:
    """A mechanism resolved in its silo's context (or none), its RDP curve and what the PLD report may do."""

    mechanism: AnyMechanism
    curve: np.ndarray
    pld_skip_reason: str | None


@dataclass(frozen=True)
class BudgetCheck:
    candidate: RunningSum
    epsilon_spent: float | None  # the silo's now; computed only where asked (a refusal, a preview)
    epsilon_if_approved: float
    fits: bool


@dataclass(frozen=True)
class Preview:
    """What approving `mechanism` on a silo would do: shared by reserve and quote."""

    priced: Priced
    silo: Silo
    check: BudgetCheck
    plan_closed: str | None  # why the silo may no longer declare a plan (None: it may)


def request_hash(*, mechanism: AnyMechanism, job_id: str | None, round: int | None) -> str:
    body = {"mechanism": mechanism.model_dump(mode="json"), "job_id": job_id, "round": round}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class SiloTerms:
    """What pricing reads of a silo: fixed at registration and covered by its create entry (only an
    admin's seal of an edited record can change them), so a serving process may keep them."""

    dataset_size: int
    relation: Relation

    @classmethod
    def of(cls, silo: Silo | SiloRecord) -> SiloTerms:
        return cls(silo.dataset_size, silo.relation)  # as stored: an edited row is compared, never parsed here


def resolved_mechanism(
    mechanism: AnyMechanism, *, silo: Silo | SiloRecord | SiloTerms | None, charged: bool, path: str
) -> AnyMechanism:
    """q filled in (the service's on a charge: see `events.resolve`) and the neighbouring relation checked."""
    resolved = resolve(mechanism, dataset_size=None if silo is None else silo.dataset_size, charged=charged, path=path)
    check_relation(resolved, silo_relation=None if silo is None else silo.relation, path=path)
    return resolved


def price(
    mechanism: AnyMechanism, *, silo: Silo | SiloRecord | SiloTerms | None, charged: bool, path: str = "mechanism"
) -> Priced:
    """Resolves q (the service's on a charge: see `events.resolve`), checks the neighbouring
    relation, bounds the work (`cost.check`) and only then computes the curve. Outside any lock: a
    new (q, σ) pair costs dp-accounting tens of milliseconds. Raises MechanismError (a 422)."""
    resolved = resolved_mechanism(mechanism, silo=silo, charged=charged, path=path)
    skip = cost.check(resolved, path=path)
    return Priced(resolved, rdp.certified_curve(resolved), skip)


def check_budget(
    silo: Silo | SiloRecord, curve: np.ndarray, *, with_spent: bool = False, on_plan: bool | None = None,
    first: rdp_filter.FirstCharge | None = None,
) -> BudgetCheck:
    """The gate: the silo's Rényi filter, fixed before its first charge (ledger/gate.py; O(orders)),
    approves only when its proven ε(spent + curve) ≤ the silo's ε (a pending silo: under the filter
    this charge, its first, would fix). A silo on a declared plan is
    checked by gate.follow_plan instead (the plan's PLD ε fit the budget when it was declared).
    Under a plan declared today the gate reads the lower of the plan's ε and the filter's while
    every charge, this one included, follows the plan (accounting/plans.py, ALONGSIDE).
    `on_plan`: whether the charge keeps the silo's plan's branch alive (gate.plan_step); `first`: the
    charge as the filter it would fix or refit reads it (gate.first_charge), where it is the silo's first."""
    spent = RunningSum.from_json(silo.rdp_spent)
    candidate = spent.add(curve)
    # A silo with no declared horizon is pending until its first charge, which fixes its filter; one
    # with a horizon may have it refit by that charge (gate.open_to_first).
    eps_candidate = gate.reading(silo, candidate, first=first, alive=on_plan).epsilon
    fits = gate.closed_by_plan(silo) or rdp.within_budget(eps_candidate, budget=silo.epsilon)
    eps_now = gate.reading(silo, spent).epsilon if with_spent or not fits else None
    return BudgetCheck(candidate, eps_now, eps_candidate, fits)


def preview(db: Database, *, silo_id: int, mechanism: AnyMechanism, charged: bool) -> Preview:
    with db.read() as session:
        silo = silos.get(session, silo_id)
        plan_closed = silos.plan_closed(session, silo)
    priced = price(mechanism, silo=silo, charged=charged)
    step = gate.plan_step(silo, priced.mechanism)
    first = gate.first_charge(silo, priced.curve, priced.mechanism)
    return Preview(priced, silo, check_budget(silo, priced.curve, with_spent=True, on_plan=step.on_plan, first=first),
                   plan_closed)


def view(
    session: Session, silo: Silo | SiloRecord, charge: Charge | ChargeRecord, *, replayed: bool,
    position: transparency.Position | None = None, own: float | None = None, spent: float | None = None,
    reference: float | None = None,
) -> ChargeView:
    """`own`, `spent`, `reference`: the charge's ε, the silo's, and dp-accounting's reference of the
    silo's (its running sum's non-adaptive RDP ε) where the caller has just computed them."""
    spent = silos.epsilon_spent(silo) if spent is None else spent
    own = float(rdp.epsilons(curve_from_json(charge.rdp), delta=silo.delta)[0]) if own is None else own
    reference = spent_reference(silo) if reference is None else reference
    where = position if position is not None else reserve_position(session, charge.id)
    return ChargeView(charge, own, spent, max(0.0, silo.epsilon - spent), replayed, where, reference)


def spent_reference(silo: Silo | SiloRecord, running: RunningSum | None = None) -> float:
    """For reference beside the gate's ε: dp-accounting's non-adaptive RDP ε (best order, whole δ)
    of the silo's reserved + committed charges (`running`: that sum where the caller holds it), by
    rdp.epsilons, dp-accounting's conversion vectorised (~20 µs against its own ~0.6 ms)."""
    curve = (RunningSum.from_json(silo.rdp_spent) if running is None else running).curve()
    return float(rdp.epsilons(curve, delta=silo.delta)[0])


def reserve_position(session: Session, charge_id: int) -> transparency.Position:
    entry = store_charges.reserve_entry(session, charge_id)
    assert entry is not None  # a charge is written with its reserve entry, and neither is ever deleted
    return transparency.position_of(session, entry)


@dataclass(frozen=True)
class Started:
    """A request priced outside any lock, ready for `finish_reserve`, with the silo terms it was
    priced under (checked again under the lock)."""

    digest: str
    priced: Priced
    mechanism: AnyMechanism  # as requested, to price again if the terms changed meanwhile
    terms: SiloTerms


def start_known(
    terms: SiloTerms, *, mechanism: AnyMechanism, job_id: str | None, round: int | None
) -> Started:
    """A request priced under silo terms the caller already holds, reading nothing: the approval is
    then one write transaction (finish_reserve). Raises MechanismError where pricing fails: the
    caller then takes `start_reserve`, which answers a replay of the key first, as always."""
    digest = request_hash(mechanism=mechanism, job_id=job_id, round=round)
    return Started(digest, price(mechanism, silo=terms, charged=True), mechanism, terms)


def start_reserve(
    session: Session, *, silo_id: int, mechanism: AnyMechanism, idempotency_key: str, job_id: str | None,
    round: int | None,
) -> ChargeView | Started:
    """In the caller's read session: the charge this key already names (a replay does no accounting
    work at all), or the request priced outside any lock (a new (q, σ) pair costs milliseconds).

    The silo's record is checked (seals.check) before a replay is answered or a pricing error is
    raised from it; a request that prices is checked under the lock (reserve_locked) before it
    approves anything. So every answer is the one a check at load would give, at one check."""
    digest = request_hash(mechanism=mechanism, job_id=job_id, round=round)
    silo = silos.get(session, silo_id, checked=False)
    earlier = by_key(session, silo_id, idempotency_key)
    if earlier is not None:
        seals.check(session, silo)
        _same_request(earlier, digest)
        return view(session, silo, earlier, replayed=True)
    try:
        priced = price(mechanism, silo=silo, charged=True)
    except Exception:
        seals.check(session, silo)  # an edited record is named (409) before anything priced from it
        raise
    first = gate.first_charge(silo, priced.curve, priced.mechanism)
    if first is not None:
        # The filter a first charge fixes costs an allocation (~65 ms for new terms): here, outside the
        # lock, into its cache; the check under the lock reads it back (or computes it, if the row changed).
        gate.fixed_spec(silo, first=first)
    return Started(digest, priced, mechanism, SiloTerms.of(silo))


def finish_reserve(
    db: Database, started: Started, *, silo_id: int, idempotency_key: str, job_id: str | None, round: int | None,
    key_id: int | None, attempt_id: str | None,
) -> ChargeView:
    """The write transaction of a reservation: the key still live, then check and append."""
    with db.write() as session:
        return reserve_locked(
            session, silo_id=silo_id, priced=started.priced, digest=started.digest, idempotency_key=idempotency_key,
            job_id=job_id, round=round, attempt_id=attempt_id, repricing=(started.mechanism, started.terms),
            key_id=key_id,
        )


def reserve(
    db: Database,
    *,
    silo_id: int,
    mechanism: AnyMechanism,
    idempotency_key: str,
    job_id: str | None = None,
    round: int | None = None,
    key_id: int | None = None,
    attempt_id: str | None = None,
) -> ChargeView:
    """A fresh reservation (replayed=False), or the charge this key already names (replayed=True).
    `attempt_id` is kept with a fresh charge and answered on every replay (never part of the
    request's identity: another attempt at the same request replays it, and learns it is not its own)."""
    with db.read() as session:
        started = start_reserve(
            session, silo_id=silo_id, mechanism=mechanism, idempotency_key=idempotency_key, job_id=job_id, round=round
        )
    if isinstance(started, ChargeView):
        return started
    return finish_reserve(
        db, started, silo_id=silo_id, idempotency_key=idempotency_key, job_id=job_id, round=round, key_id=key_id,
        attempt_id=attempt_id,
    )


def reserve_locked(
    session: Session,
    *,
    silo_id: int,
    priced: Priced,
    digest: str,
    idempotency_key: str,
    job_id: str | None,
    round: int | None,
    attempt_id: str | None = None,
    repricing: tuple[AnyMechanism, SiloTerms] | None = None,
    key_id: int | None = None,
) -> ChargeView:
    """Check, then append, inside the caller's write transaction (the silo is locked here, and the
    caller's key `key_id` read live first: a key revoked meanwhile writes nothing).
    `repricing`: the request and the terms `priced` was computed under, priced again here if the
    locked record's differ (a seal since: the pair is then priced under the lock, once)."""
    store = reserving.of(session)
    locked, earlier = _lock(session, store, silo_id, key_id=key_id, idempotency_key=idempotency_key)
    silo = locked.silo
    if earlier is not None:  # a replay, or a concurrent retry that landed before this lock
        _same_request(earlier, digest)
        return view(session, silo, earlier, replayed=True)
    if repricing is not None and repricing[1] != SiloTerms.of(silo):
        priced = price(repricing[0], silo=silo, charged=True)
    silos.refuse_if_retired(silo)  # after a replay (a read of a charge made before), before any approval
    step = gate.follow_plan(silo, priced.mechanism)  # on a plan of the rule before: only its next units, else a 409
    first = gate.first_charge(silo, priced.curve, priced.mechanism)
    decision = check_budget(silo, priced.curve, on_plan=step.on_plan, first=first)
    if not decision.fits:
        assert decision.epsilon_spent is not None
        raise OverBudget(
            budget=silo.epsilon, epsilon_spent=decision.epsilon_spent, epsilon_if_approved=decision.epsilon_if_approved,
            epsilon_dp_accounting=rdp.epsilon(decision.candidate.curve(), delta=silo.delta)[0],
        )
    now = datetime.now(UTC)
    # With its filter fixed before and no plan, the silo's ε after this charge is the check's reading
    # (the same filter read on the same sum); else the answer reads it again after the changes below.
    spent_after = decision.epsilon_if_approved if first is None and silo.plan is None else None
    if first is not None:  # its first charge: the filter it was checked under is fixed (or refit) now, before it
        silos.fix_filter(session, silo, first, now=now)
    gate.take(silo, step, seq=silo.chain_seq + 1)  # its units of the plan, or the plan's branch ends at its entry
    curve_text = curve_to_json(priced.curve)
    # The curve is stored once per ledger (store/curves.py): the charge names it by key, and a curve this
    # process knows committed (a repeated pair: the common path) is not written again.
    curve_hash, new_curve = curves.reference(session, curve_text)
    values: dict[str, Any] = {
        "silo_id": silo_id, "idempotency_key": idempotency_key, "request_hash": digest,
        "mechanism": priced.mechanism.model_dump_json(), "curve_hash": curve_hash,
        "order_grid": rdp.ORDER_GRID_ID, "conversion": rdp.LEDGER_CONVERSION_ID, "status": ChargeStatus.reserved,
        "job_id": job_id, "round": round, "epsilon_spent_after": decision.epsilon_if_approved, "created_at": now,
        "touched_at": None, "attempt_id": attempt_id,
    }
    # Core, not the unit of work's flush of a new object: the row is not read back in this transaction,
    # and the answer needs only these values and the id (the store writes it now or with its entry).
    new = store.insert_charge(session, values, locked=locked, curve=(curve_hash, curve_text) if new_curve else None)
    charge = ChargeRecord(id=new.id, rdp=curve_text, **values)
    position = silos.append_entry(
        session, silo, event=EntryEvent.reserve, charge=charge, epsilon_spent=decision.epsilon_if_approved, now=now,
        rdp_spent=decision.candidate.to_json(), new_charge=new,
    )
    # dp-accounting's conversion, vectorised (as view): the charge's own ε, and the reference of the sum after it.
    own, reference = (float(e) for e in rdp.epsilons(np.vstack([priced.curve, decision.candidate.curve()]), delta=silo.delta))
    return view(session, silo, charge, replayed=False, position=position, own=own, spent=spent_after, reference=reference)


def _lock(
    session: Session, store: reserving.Reserving, silo_id: int, *, key_id: int | None, idempotency_key: str
) -> tuple[reserving.Locked, Charge | None]:
    """keys.require_live, silos.lock and by_key, in that order of refusals, in two statements: the lock
    with the key's liveness, then the record's check with the charge the key names (store/reserving.py
    says why that read comes after the lock)."""
    locked = store.lock(session, silo_id=silo_id, key_id=key_id)
    if locked is None:
        keys.require_live(session, key_id)  # a revoked key learns nothing about the silo
        raise NotFound(f"silo {silo_id} not found")
    if not locked.key_live:
        raise Unauthorized("unknown or revoked API key")
    earlier = seals.check(session, locked.silo, key=reserving.AfterLock(locked, idempotency_key))
    return locked, None if earlier is None else session.get(Charge, earlier)


def by_key(session: Session, silo_id: int, idempotency_key: str) -> Charge | None:
    # A fresh key (every approval) costs one Core read of the unique index, no ORM load; a replay
    # then loads its charge.
    found = reserving.charge_by_key(session, silo_id=silo_id, idempotency_key=idempotency_key)
    return None if found is None else session.get(Charge, found)


def _same_request(earlier: Charge | ChargeRecord, digest: str) -> None:
    if earlier.request_hash != digest:
        raise InvalidRequest(
            "idempotency_key",
            f"was already used for a different request to this silo (charge {earlier.id}, {ChargeStatus(earlier.status).value}); "
            "a key names one charge for good",
        )


def get(db: Database, charge_id: int, *, silo_scope: int | None) -> ChargeView:
    """The charge as it stands. `silo_scope`: the one silo the caller may see (None: every silo);
    a charge of another silo is "not found", exactly like one that does not exist."""
    with db.read() as session:
        charge = _visible(session, charge_id, silo_scope)
        return view(session, silos.get(session, charge.silo_id), charge, replayed=False)


def list_for_silo(
    db: Database, silo_id: int, *, status: ChargeStatus | None = None, job_id: str | None = None, limit: int = 10_000
) -> list[ChargeView]:
    with db.read() as session:
        silo = silos.get(session, silo_id)
        spent, reference = silos.epsilon_spent(silo), spent_reference(silo)  # the silo's, once for all its charges
        found = store_charges.of_silo(session, silo_id, status=status, job_id=job_id, limit=limit)
        return [view(session, silo, charge, replayed=False, spent=spent, reference=reference) for charge in found]


def _visible(session: Session, charge_id: int, silo_scope: int | None) -> Charge:
    charge = session.get(Charge, charge_id)
    if charge is None or (silo_scope is not None and charge.silo_id != silo_scope):
        raise NotFound(f"charge {charge_id} not found")
    return charge


def commit(db: Database, *, charge_id: int, silo_scope: int | None = None, key_id: int | None = None) -> Settlement:
    """The round ran: the reservation becomes a committed charge (ε_spent is unchanged)."""
    return _settle(db, charge_id=charge_id, event=EntryEvent.commit, silo_scope=silo_scope, key_id=key_id)


def release(db: Database, *, charge_id: int, silo_scope: int | None = None, key_id: int | None = None) -> Settlement:
    """Only for a round that never touched the data: the reservation's curve is returned. Refused
    (409) once anything the round produced reached the ledger: then it may only be committed."""
    return _settle(db, charge_id=charge_id, event=EntryEvent.release, silo_scope=silo_scope, key_id=key_id)


def _settle(db: Database, *, charge_id: int, event: EntryEvent, silo_scope: int | None, key_id: int | None) -> Settlement:
    # One write transaction: the charge names its silo, the silo is locked, the charge read again.
    with db.write() as session:
        keys.require_live(session, key_id)
        silo_id = _visible(session, charge_id, silo_scope).silo_id
        silo = silos.lock(session, silo_id)
        charge = session.get(Charge, charge_id, populate_existing=True, with_for_update=True)
        assert charge is not None  # charges are never deleted
        if charge.status != ChargeStatus.reserved:
            raise SettledAlready(charge_id, ChargeStatus(charge.status).value)
        if event is EntryEvent.release:
            _check_untouched(session, charge)
        _check_as_reserved(session, charge)
        curve = curve_from_json(charge.rdp)
        spent = RunningSum.from_json(silo.rdp_spent)
        rdp_spent = rdp_committed = None  # the running sum the event changes, written with its entry
        if event is EntryEvent.commit:
            charge.status = ChargeStatus.committed
            rdp_committed = RunningSum.from_json(silo.rdp_committed).add(curve).to_json()
        else:
            charge.status = ChargeStatus.released
            spent = spent.subtract(curve)
            rdp_spent = spent.to_json()
        eps = gate.reading(silo, spent).epsilon  # as silos.epsilon_spent reads the stored sum
        position = silos.append_entry(session, silo, event=event, charge=charge, epsilon_spent=eps,
                                      now=datetime.now(UTC), rdp_spent=rdp_spent, rdp_committed=rdp_committed)
        return Settlement(charge_id, ChargeStatus(charge.status), eps, position, spent_reference(silo, spent))


def _check_as_reserved(session: Session, charge: Charge) -> None:
    """The charge's curve is what its reserve entry's hash covers: a release subtracts it from the running
    sum, which the silo's record check then derives from the chain (ledger/replayed.py), so a curve edited
    upward would otherwise lower the sum by more than was reserved, and an edit that no longer parses
    would answer a 500."""
    entry = store_charges.reserve_entry(session, charge.id)
    if entry is None or chain.entry_hash(entry, subject=chain.charge_fields(charge)) != entry.hash:
        where = "has no reserve entry" if entry is None else f"no longer matches its reserve entry (seq {entry.seq})'s hash"
        raise Conflict(f"charge {charge.id} {where}: it is settled only as it was reserved; GET /v1/audit/verify names "
                       "every broken entry")


def _check_untouched(session: Session, charge: Charge) -> None:
    if store_charges.pays_for_search(session, charge.id):
        # A search's trials query the data as soon as K is known: its charge settles only by
        # reporting them, never by a release that would hand the budget back.
        raise Conflict(f"charge {charge.id} pays for a hyperparameter search; it is committed by the search's last trial")
    if charge.touched_at is not None:
        raise Conflict(
            f"charge {charge.id}'s round already reported an output to the ledger (a norm or a trial), so it touched "
            "the data: it may only be committed"
        )


def mark_touched(session: Session, *, silo_id: int, charge_id: int | None = None, round: int | None = None) -> None:
    """An output of a round reached the ledger: its charge (and, fail closed, every reserved charge
    of the silo for that round) may no longer be released. Caller holds the write transaction."""
    now = datetime.now(UTC)
    if charge_id is not None:
        charge = session.get(Charge, charge_id)
        if charge is None or charge.silo_id != silo_id:
            raise NotFound(f"charge {charge_id} not found")
        if charge.status == ChargeStatus.released:
            raise Conflict(f"charge {charge_id} was released: its round must not have run, so it cannot report an output")
        if charge.touched_at is None:
            charge.touched_at = now
    if round is not None:
        for charge in store_charges.reserved_untouched(session, silo_id=silo_id, round=round):
            charge.touched_at = now
