"""Silos: registration (with the genesis entry of their chain), their budget as it stands, and
retirement (an admin stops a mis-registered silo for good: `retire`, `refuse_if_retired`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans, rdp, reports
from dpledger.service.accounting.events import MechanismError, resolve
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger import chain, gate, replayed, seals, transparency
from dpledger.service.ledger.errors import Conflict, InvalidRequest, NotFound, OverBudget
from dpledger.service.ledger.keys import create_key
from dpledger.service.store import reserving
from dpledger.service.store import silos as store_silos
from dpledger.service.store.db import Database
from dpledger.service.store.models import (
    Charge,
    ChargeRecord,
    EntryEvent,
    EntryRecord,
    Role,
    Silo,
    SiloRecord,
)
from dpledger.wire.enums import Relation
from dpledger.wire.mechanisms import AnyMechanism, DpSgd


@dataclass(frozen=True)
class BudgetStatus:
    epsilon_spent: float
    epsilon_committed: float
    epsilon_remaining: float
    rho: float | None
    order: float


def _stored(silo: Silo | SiloRecord, columns: dict[str, Any]) -> None:
    """Sets columns the store wrote on the object as stored, so the unit of work does not write them
    again: its flush of the row cost an approval as much as the entry's and the charge's inserts together."""
    if isinstance(silo, SiloRecord):
        silo.stored(columns)
        return
    for column, value in columns.items():
        set_committed_value(silo, column, value)


def filter_for(*, epsilon: float, delta: float, dataset_size: int, horizon: AnyMechanism | None = None) -> rdp_filter.FilterSpec:
    """The filter a new silo commits to: from its budget and a declared horizon (the workload it
    expects); with none, a pending filter that its first charge replaces (fix_filter); never from
    anything a charge returns."""
    if horizon is None:
        try:
            return rdp_filter.pending_spec(epsilon=epsilon, delta=delta, dataset_size=dataset_size)
        except ValueError as error:  # was a 500: ε = 1e-12 (or 1e-3) at δ 1e-5, ε ≤ 1 at δ 0.999
            # The default workload scaled to this budget reads ε 0 or ∞ at every order: a δ near 1 makes every
            # order's ε 0, a tiny ε leaves no order finite. Which field to change: δ where it is that large.
            raise InvalidRequest("delta" if delta >= 0.5 else "epsilon", (
                f"no filter can be fixed for ε={epsilon!r} at δ={delta!r}: the default workload scaled to it "
                f"({error}); register with a larger ε{' or a smaller δ' if delta >= 0.5 else ''}, or declare a "
                "horizon (the workload this silo will run)")) from error
    try:
        resolved = resolve(horizon, dataset_size=dataset_size, path="horizon")
        return rdp_filter.declared_spec(epsilon=epsilon, delta=delta, horizon=resolved)
    except MechanismError as error:
        raise InvalidRequest(error.field if error.field.startswith("horizon") else "horizon", error.message) from error
    except ValueError as error:
        raise InvalidRequest("horizon", str(error)) from error


def register(
    db: Database, *, name: str, epsilon: float, delta: float, dataset_size: int, relation: Relation = Relation.add_remove,
    horizon: AnyMechanism | None = None,
) -> tuple[Silo, str]:
    """Creates the silo with its filter, its chain's genesis entry (covering both) and its first key,
    in one transaction."""
    spec = filter_for(epsilon=epsilon, delta=delta, dataset_size=dataset_size, horizon=horizon)
    empty = RunningSum.empty(len(rdp.ORDERS)).to_json()
    now = datetime.now(UTC)
    try:
        with db.write() as session:
            silo = Silo(
                name=name, epsilon=epsilon, delta=delta, dataset_size=dataset_size, relation=relation,
                rdp_spent=empty, rdp_committed=empty, chain_seq=0, chain_head=chain.GENESIS, created_at=now,
                filter_spec=spec.to_json(), filter_seq=1 if horizon is not None else gate.PENDING_SEQ,
                plan=None, plan_used=0,
            )
            session.add(silo)
            session.flush()
            append_entry(session, silo, event=EntryEvent.create, charge=None, epsilon_spent=0.0, now=now)
            _, raw = create_key(session, role=Role.silo, silo_id=silo.id)
    except IntegrityError as error:
        raise Conflict(_name_taken(db, name)) from error
    return silo, raw


def _name_taken(db: Database, name: str) -> str:
    """Why a name is refused: a retired silo keeps its name for good (in its entries and the log, a name
    names one record for auditors), so the admin who retired a mis-registered silo is told to pick another."""
    with db.read() as session:
        holder = store_silos.by_name(session, name)
    if holder is None or holder.retired_seq is None:
        return f"a silo named {name!r} exists already"
    return (f"a silo named {name!r} exists already (silo {holder.id}, retired: {holder.retired_reason}); "
            "register the corrected silo under another name")


class Retired(Conflict):
    """A request that would approve budget on a retired silo: it approves nothing, ever again."""

    def __init__(self, silo: Silo | SiloRecord) -> None:
        super().__init__(f"silo {silo.id} is retired (entry {silo.retired_seq}: {silo.retired_reason}): it approves "
                         "nothing; register a new silo")
        self.silo_id = silo.id
        self.seq = silo.retired_seq
        self.reason = silo.retired_reason


def refuse_if_retired(silo: Silo | SiloRecord) -> None:
    """The one check every path that approves or plans budget makes (reserve, hence searches and the
    pending filter's fix; a plan; σ calibration and round quotes; a seal), after its silo is loaded and
    checked (seals.check covers the retire entry). Settling a reservation made before the retirement
    does not call it: a round that may have touched data must still be committed."""
    if silo.retired_seq is not None:
        raise Retired(silo)


def retire(db: Database, silo_id: int, *, reason: str) -> int:
    """Retires the silo for good in a `retire` entry of its chain and of the transparency log, whose hash
    covers the silo's identity and `reason`; returns the entry's seq. Nothing is refunded, edited or
    hidden: the record, its charges and its entries stay as they are. A 409 if it is retired already,
    or if its record is tampered (restored or sealed first, so the entry covers a sound record)."""
    with db.write() as session:
        silo = lock(session, silo_id)
        if silo.retired_seq is not None:
            raise Conflict(f"silo {silo_id} is retired already (entry {silo.retired_seq}: {silo.retired_reason})")
        silo.retired_reason = reason  # before the entry, whose hash covers it (chain.retire_fields)
        position = append_entry(session, silo, event=EntryEvent.retire, charge=None,
                                epsilon_spent=epsilon_spent(silo), now=datetime.now(UTC))
        silo.retired_seq = position.seq
        return position.seq


def fix_filter(session: Session, silo: Silo | SiloRecord, first: rdp_filter.FirstCharge, *, now: datetime) -> None:
    """Fixes a pending silo's filter from its first charge's curve (filter.first_charge_spec says why
    that is sound), or refits a registered one (filter.refit_spec; else nothing is written), in a
    filter entry that covers it, written before the charge's reserve entry in
    the same transaction: a refused first charge fixes nothing. The caller holds the silo's lock."""
    # The filter as it is fixed, its shares unscaled: the gate scales it to the share a plan leaves it at
    # every read (gate.spec), so storing the scaled one would halve it twice.
    spec = gate.fixed_spec(silo, first=first)
    if gate.refittable(silo):
        if spec.source != "refit":
            return  # its registered filter kept: the create entry covers it still, nothing to write
        silo.registered_filter = silo.filter_spec  # the create entry covers it (chain.create_fields)
    silo.filter_spec = spec.to_json()
    silo.filter_seq = silo.chain_seq + 1
    append_entry(session, silo, event=EntryEvent.filter, charge=None, epsilon_spent=0.0, now=now)


def append_entry(
    session: Session, silo: Silo | SiloRecord, *, event: EntryEvent, charge: Charge | ChargeRecord | None, epsilon_spent: float,
    now: datetime, rdp_spent: str | None = None, rdp_committed: str | None = None,
    new_charge: reserving.NewCharge | None = None,
) -> transparency.Position:
    """Appends one entry to the silo's chain and, in the same transaction, its leaf to the
    transparency log's pending leaves (sequenced within the promised delay, transparency.py); the
    caller holds the silo's lock. `rdp_spent`, `rdp_committed`: the silo's running sums after the
    entry's event, written with its chain fields. `new_charge`: `charge` as the store gave it its id,
    with its row where the store writes it with the entry (store/reserving.py). Returns the entry's leaf
    and its promise."""
    # What this process derived of the chain through the previous entry (seals.check, under this lock),
    # and the sums as they read then: extended by this entry below (replayed.extend).
    derived = replayed.genesis(track_plan=False) if silo.chain_seq == 0 else seals.derived(session, silo)
    before = (silo.rdp_spent, silo.rdp_committed)
    entry = EntryRecord(
        silo_id=silo.id, seq=silo.chain_seq + 1, event=event, charge_id=None if charge is None else charge.id,
        epsilon_spent=epsilon_spent, created_at=now, prev_hash=silo.chain_head, hash="",
    )
    subject_text = chain.canonical(chain.subject(event, silo, charge))  # for the entry's hash and its leaf
    entry.hash = chain.entry_hash(entry, subject_text=subject_text)
    # What the caller changed through the ORM (a charge's status, a plan), then the silo's chain and sums
    # in one UPDATE, the entry in one INSERT and its leaf, rather than the unit of work's flush of the row
    # and of a new object. An approval's record is no ORM object: what it changed on it (a first charge's
    # filter, a plan's units) goes into that UPDATE.
    session.flush()
    changed = silo.changed() if isinstance(silo, SiloRecord) else {}
    columns = {**changed, "chain_seq": entry.seq, "chain_head": entry.hash,
               **{column: text for column, text in (("rdp_spent", rdp_spent), ("rdp_committed", rdp_committed))
                  if text is not None}}
    leaf, position = transparency.pending_leaf(entry, subject_text=subject_text)
    reserving.of(session).append(session, reserving.Appended(
        silo.id, columns, {column: getattr(entry, column) for column in reserving.ENTRY_COLUMNS}, leaf, new_charge))
    _stored(silo, columns)
    _derive(session, silo, derived, event=event, before=before)
    return position


def _derive(session: Session, silo: Silo | SiloRecord, derived: replayed.State | None, *, event: EntryEvent,
            before: tuple[str, str]) -> None:
    """Keeps what the chain makes of the record after the entry just written, where this process held
    it before: the next check of the silo then replays nothing. (Kept before the transaction commits:
    one that rolls back leaves the chain's end behind it, and the next check replays from the start.)"""
    if derived is None:
        return
    if silo.chain_seq == 1:  # the create entry: the registered sums are the empty ones the chain starts from
        derived = replace(derived, texts=before)
    seals.keep(session, silo.id, replayed.extend(derived, silo, event=event, before=before))


def get(session: Session, silo_id: int, *, checked: bool = True) -> Silo:
    """The silo row; `checked`: only if its record still matches its entries' hashes (seals.Tampered)."""
    silo = session.get(Silo, silo_id)
    if silo is None:
        raise NotFound(f"silo {silo_id} not found")
    if checked:
        seals.check(session, silo)
    return silo


def lock(session: Session, silo_id: int, *, checked: bool = True) -> Silo:
    """The silo row, locked until the transaction ends (FOR UPDATE; SQLite's IMMEDIATE lock already
    serialises writers); `checked` as in `get`, under the lock, so no approval reads an edited record."""
    silo = reserving.lock_silo(session, silo_id)
    if silo is None:
        raise NotFound(f"silo {silo_id} not found")
    if checked:
        seals.check(session, silo)
    return silo


def list_all(session: Session) -> list[Silo]:
    return store_silos.all_silos(session)


def status(silo: Silo) -> BudgetStatus:
    """The silo's proven ε (its gate's: filter or plan), and zCDP ρ of its running sum."""
    running = RunningSum.from_json(silo.rdp_spent)
    spent = gate.reading(silo, running)
    committed = gate.reading(silo, RunningSum.from_json(silo.rdp_committed))
    return BudgetStatus(
        epsilon_spent=spent.epsilon,
        epsilon_committed=committed.epsilon,
        epsilon_remaining=remaining(silo, spent.epsilon),
        rho=rdp.rho(running.curve()),
        order=spent.order,
    )


def remaining(silo: Silo, epsilon_spent: float) -> float:
    if gate.closed_by_plan(silo):
        return 0.0  # a plan declared under the rule before is the silo's whole budget (plans.AFTER_PLAN)
    return max(0.0, silo.epsilon - epsilon_spent)


def epsilon_spent(silo: Silo | SiloRecord) -> float:
    return gate.reading(silo, RunningSum.from_json(silo.rdp_spent)).epsilon


def plan_closed(session: Session, silo: Silo) -> str | None:
    """Why the silo may no longer declare a plan, or None: a plan is fixed once, before any charge."""
    if silo.plan is not None:
        return f"silo {silo.id} has declared its plan already; a plan is fixed once"
    if silo.sealed_seq is not None:  # the seal's hash covers the record with no plan (seals.sealable)
        return f"silo {silo.id}'s record is sealed as it stood, with no plan; a plan is declared before a seal"
    if store_silos.holds_charges(session, silo.id):
        return f"silo {silo.id} holds charges already; a plan must be declared before the first charge"
    return None


def declare_plan(db: Database, *, silo_id: int, mechanism: AnyMechanism) -> plans.Plan:
    """Fixes the silo's plan: only before its first charge, once, and only if its PLD ε (on the
    plan's share of δ, plans.PLAN_DELTA_SHARE) fits. The filter keeps approving beside it."""
    with db.read() as session:
        silo = get(session, silo_id)
        refuse_if_retired(silo)  # before its price is computed: a retired silo plans nothing
        dataset_size, delta, budget = silo.dataset_size, silo.delta, silo.epsilon
    try:
        resolved = resolve(mechanism, dataset_size=dataset_size)
        segments = plans.segments(resolved)
        price = plans.pld_epsilon(resolved, delta=delta * plans.PLAN_DELTA_SHARE)
    except MechanismError as error:
        raise InvalidRequest(error.field, error.message) from error
    if not rdp.within_budget(price, budget=budget):
        raise OverBudget(budget=budget, epsilon_spent=0.0, epsilon_if_approved=price)
    declared = plans.Plan(mechanism=resolved.model_dump_json(), segments=tuple(segments), epsilon=price)
    with db.write() as session:
        silo = lock(session, silo_id)
        refuse_if_retired(silo)  # again under the lock: a retirement may have landed since the read
        closed = plan_closed(session, silo)
        if closed is not None:
            raise Conflict(closed)
        silo.plan = declared.to_json()
        silo.plan_used = 0
        silo.plan_ended_seq = None
        append_entry(session, silo, event=EntryEvent.plan, charge=None, epsilon_spent=0.0, now=datetime.now(UTC))
    return declared


# The calibrations plan_noise tries on a silo whose first charge may refit its filter: each σ under the
# filter the previous σ's first charge leaves; the two agree after one or two.
REFIT_CALIBRATIONS = 6


@dataclass(frozen=True)
class NoisePlan:
    noise_multiplier: float
    sampling_rate: float
    epsilon_after: float


def plan_noise(silo: Silo, *, batch_size: int, steps: int, first_steps: int | None = None) -> NoisePlan:
    """The σ that lets `steps` more DP-SGD steps at q = batch_size / the registered dataset_size fit
    what the silo has left (reserved charges count as spent). Reserves nothing. `first_steps`: the
    steps of one charge of them (default: all in one), which fixes a pending silo's filter."""
    refuse_if_retired(silo)  # a σ for rounds that would all be refused would only start a doomed job
    if silo.relation != Relation.add_remove:
        raise InvalidRequest(
            "silo_id", f"DP-SGD is analysed under add_remove; this silo is registered with relation={silo.relation}"
        )
    if batch_size > silo.dataset_size:
        raise InvalidRequest("batch_size", f"must be at most the silo's dataset_size={silo.dataset_size}. Found {batch_size}.")
    sampling_rate = batch_size / silo.dataset_size
    if gate.closed_by_plan(silo):
        raise Conflict(f"silo {silo.id} is on its declared plan: its noise is the plan's, nothing else is approved")
    # Beside a plan: σ by the filter alone (a σ of the search's own is off the plan, or the plan's). A
    # pending silo: at each σ, under the filter its first charge would fix. One registered with a horizon
    # that its first charge may refit: under the registered filter first, then under the filter the
    # first charge at that σ leaves, until the two agree: the σ quoted is one whose rounds the gate then
    # approves under the filter its first charge fixes.
    fixed = None if gate.pending(silo) else gate.spec(silo)
    unit = (first_steps or steps) / steps  # a pending silo's spent sum is empty: the curve is the run's
    spent = RunningSum.from_json(silo.rdp_spent).curve()

    def epsilon_of(curve: np.ndarray) -> float:  # the gate's conversion, under the filter it would read
        spec = fixed if fixed is not None else gate.spec(silo, first=rdp_filter.FirstCharge(curve * unit))
        return rdp_filter.read(spec, curve, delta=silo.delta).epsilon

    def calibrated(epsilon_of: Callable[[np.ndarray], float]) -> reports.RemainingCalibration:
        try:
            return reports.calibrate_remaining(spent, budget=silo.epsilon, sampling_rate=sampling_rate, steps=steps,
                                               epsilon_of=epsilon_of)
        except MechanismError as error:
            raise InvalidRequest(error.field, error.message) from error

    def reading(spec: rdp_filter.FilterSpec) -> Callable[[np.ndarray], float]:
        return lambda curve: rdp_filter.read(spec, curve, delta=silo.delta).epsilon

    found = calibrated(epsilon_of)
    if not gate.refittable(silo):
        return NoisePlan(noise_multiplier=found.noise_multiplier, sampling_rate=sampling_rate,
                         epsilon_after=found.epsilon_after)
    sigma = found.noise_multiplier
    for _ in range(REFIT_CALIBRATIONS):
        run = rdp.certified_curve(DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=sampling_rate))
        # The first charge as the job sends it, so that the refit reads whether the horizon names it.
        sent = resolve(DpSgd(noise_multiplier=sigma, steps=first_steps or steps, batch_size=batch_size),
                       dataset_size=silo.dataset_size, charged=True)
        after = gate.spec(silo, first=rdp_filter.FirstCharge(run * unit, trains=True, digest=rdp_filter.mechanism_digest(sent)))
        epsilon_after = rdp_filter.read(after, run, delta=silo.delta).epsilon
        if rdp.within_budget(epsilon_after, budget=silo.epsilon):
            return NoisePlan(noise_multiplier=sigma, sampling_rate=sampling_rate, epsilon_after=epsilon_after)
        # The refit at σ buys fewer of these rounds than the filter σ was calibrated under: σ again under
        # it (never smaller: the refit reads the run above the budget at σ), until the two agree.
        sigma = max(sigma * (1 + reports.SIGMA_RELATIVE_TOLERANCE), calibrated(reading(after)).noise_multiplier)
    raise Conflict(f"no σ found whose {steps} steps the filter their first charge fixes approves within ε={silo.epsilon:g} "
                   f"after {REFIT_CALIBRATIONS} calibrations: charge a first step, then ask again")
