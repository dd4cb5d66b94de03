"""Verification of the stored ledger: every hash recomputed from the stored rows, every charge's
status against its entries, every running sum against its charges. Off the request path: this
replays history on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.orm import Session

from dpledger.service.accounting import plans, rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_from_json
from dpledger.service.ledger import chain, seals
from dpledger.service.store import curves, records
from dpledger.service.store.models import (
    Charge,
    ChargeStatus,
    EntryEvent,
    Silo,
)
from dpledger.wire.chain_replay import ChainReplay, Link
from dpledger.wire.mechanisms import AnyMechanism, Mechanism

_MECHANISM: TypeAdapter[AnyMechanism] = TypeAdapter(Mechanism)


@dataclass
class Report:
    entries: int = 0
    first_bad_seq: int | None = None
    first_bad_silo_id: int | None = None
    bad_charge_ids: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def flag(self, silo_id: int, seq: int | None, problem: str, charge_id: int | None = None) -> None:
        self.problems.append(f"silo {silo_id}: {problem}")
        if charge_id is not None and charge_id not in self.bad_charge_ids:
            self.bad_charge_ids.append(charge_id)
        if seq is not None and self.first_bad_seq is None:
            self.first_bad_seq, self.first_bad_silo_id = seq, silo_id


def verify(session: Session, silo_ids: list[int] | None = None) -> Report:
    report = Report()
    for silo in records.silos_in_order(session, silo_ids):
        _verify_silo(session, silo, report)
    return report


def _verify_silo(session: Session, silo: Silo, report: Report) -> None:
    """The chain's own rules (`ChainReplay`, the replay an auditor's check of the signed log runs too),
    then what only the stored rows can show: each entry's hash over the record or charge it covers, and
    the silo's columns that the chain decides."""
    charges = {c.id: c for c in records.charges_of(session, silo.id)}
    entries = records.entries_of(session, silo.id)
    replay = ChainReplay()
    filter_entries: list[int] = []
    for entry in entries:
        report.entries += 1
        charge = charges.get(entry.charge_id) if entry.charge_id is not None else None
        # A charge entry naming no charge of this silo moves none: it is named below, and its hash checked.
        step = replay.step(Link(entry.seq, entry.prev_hash, entry.hash, entry.event, None if charge is None else charge.id))
        if step.expected_seq is not None:
            report.flag(silo.id, entry.seq, f"entry seq {entry.seq} where {step.expected_seq} was expected")
        if step.unlinked:
            report.flag(silo.id, entry.seq, f"entry {entry.seq} does not link to the entry before it", entry.charge_id)
        event = step.event
        if event is None:  # an edited row must be reported, not crash the audit
            report.flag(silo.id, entry.seq, f"entry {entry.seq} has an unknown event {entry.event!r}", entry.charge_id)
            subject = {}
        elif event in seals.RECORD_EVENTS:
            subject = chain.subject(event, silo, None)
            if event is EntryEvent.filter:
                filter_entries.append(entry.seq)
                if entry.seq != silo.filter_seq:
                    report.flag(silo.id, entry.seq,
                                f"entry {entry.seq} records a filter, but the silo's filter is at entry {silo.filter_seq}")
            if event is EntryEvent.plan and silo.plan is None:
                report.flag(silo.id, entry.seq, f"entry {entry.seq} records a plan the silo does not hold")
            if event is EntryEvent.retire:
                _check_retire(silo, entry.seq, step.retired_before, report)
        elif charge is None:
            report.flag(silo.id, entry.seq, f"entry {entry.seq} names charge {entry.charge_id}, which is not this silo's")
            subject = {}
        else:
            subject = chain.charge_fields(charge)
            if event is EntryEvent.reserve and step.retired_before is not None:
                # e.g. retired_seq nulled in the database, and charging resumed
                report.flag(silo.id, entry.seq, f"entry {entry.seq} reserves charge {charge.id} after the silo's "
                            f"retire entry {step.retired_before}: a retired silo approves nothing", charge.id)
            if step.misordered:
                before = step.status_before
                report.flag(
                    silo.id, entry.seq,
                    f"entry {entry.seq} ({event.value}) of charge {charge.id} follows "
                    f"{'no entry' if before is None else 'its ' + before.value + ' entry'}", charge.id,
                )
        # An entry that covered the record before an admin's seal covers what the row held then, which
        # the seal accepted was lost: the seal's entry (and the transparency log's leaf) stand for it.
        # A retire entry is never superseded: a retired silo cannot be sealed (seals.seal).
        superseded = event in seals.RECORD_EVENTS and event is not EntryEvent.retire and entry.seq < (silo.sealed_seq or 0)
        if not superseded and chain.entry_hash(entry, subject=subject) != entry.hash:
            report.flag(silo.id, entry.seq, f"entry {entry.seq} ({entry.event}) does not match its hash", entry.charge_id)
    if silo.chain_head != replay.head or silo.chain_seq != replay.seq:
        report.flag(silo.id, replay.seq + 1, "the silo's chain head is not the last entry (an entry was removed)")
    if silo.retired_seq is not None and replay.retired_seq is None:
        report.flag(silo.id, silo.retired_seq, f"the silo's record says it was retired at entry {silo.retired_seq}, "
                    "but no retire entry of its chain is there")
    if silo.filter_seq != 1 and filter_entries != ([] if silo.filter_seq == 0 else [silo.filter_seq]):
        # Seq 1 is the create entry, whose hash covers the filter; 0, a filter its first charge is still
        # to fix (none may cover it); otherwise exactly one filter entry must.
        report.flag(silo.id, None, f"the silo's filter (entry {silo.filter_seq}) is covered by no filter entry of its chain")
    _verify_charges(silo, charges, replay.statuses, report)
    _verify_plan(silo, [(seq, charges[charge_id]) for seq, charge_id in replay.reserves], report)


def _check_retire(silo: Silo, seq: int, earlier: int | None, report: Report) -> None:
    """A retire entry must be the silo's only one, and the one its record points at: a record that
    no longer says so (retired_seq nulled or moved) would approve again on a silo retired for good."""
    if earlier is not None:
        report.flag(silo.id, seq, f"entry {seq} retires the silo again, after its retire entry {earlier}")
    elif silo.retired_seq != seq:
        says = "it is in service" if silo.retired_seq is None else f"it was retired at entry {silo.retired_seq}"
        report.flag(silo.id, seq, f"entry {seq} retired the silo, but the silo's record says {says}")


def _verify_plan(silo: Silo, reserves: list[tuple[int, Charge]], report: Report) -> None:
    """The silo's place on its plan (units taken; the reserve entry that ended the branch) is covered by
    no hash: it is a function of the plan and of the charges in the order they were reserved, so it is
    recomputed from them here, and an edit that would revive an ended branch is named."""
    if silo.plan is None:
        return
    try:
        declared = plans.Plan.from_json(silo.plan)
    except (ValueError, TypeError, KeyError):  # an edited plan: its entry's hash names it already
        report.flag(silo.id, None, "the silo's plan does not parse, so its place on it cannot be recomputed")
        return
    used, ended = 0, None
    for seq, charge in reserves:
        try:
            units = plans.segments(_MECHANISM.validate_json(charge.mechanism))
        except (ValidationError, ValueError):  # an edited mechanism: reported by the entry's hash already
            return
        taken = plans.follows(declared, used=used, charge=units)
        if taken is None:
            ended = seq
            break
        used += taken
    if (silo.plan_used, silo.plan_ended_seq) != (used, ended):
        report.flag(silo.id, ended, f"the silo's place on its plan ({silo.plan_used} units taken, branch ended at entry "
                    f"{silo.plan_ended_seq}) is not what its charges make it ({used} units taken, branch ended at entry "
                    f"{ended})")


def _verify_charges(silo: Silo, charges: dict[int, Charge], status_from_log: dict[int, ChargeStatus], report: Report) -> None:
    spent = RunningSum.empty(len(rdp.ORDERS))
    committed = RunningSum.empty(len(rdp.ORDERS))
    # What a released charge may leave behind: its add rounded up and its subtraction moved up by a
    # spacing of the sum (running_sum.py) each leave a few ulps of the curve; the rest is rtol's.
    residue = np.zeros(len(rdp.ORDERS))
    for charge in charges.values():
        logged = status_from_log.get(charge.id)
        if logged is None:
            report.flag(silo.id, None, f"charge {charge.id} has no entry in the chain", charge.id)
        elif charge.status != logged.value:
            report.flag(
                silo.id, None, f"charge {charge.id} is stored {charge.status!r} but its entries say {logged.value}", charge.id
            )
        if charge.rdp is not None and curves.mismatched(charge.curve_hash, charge.rdp):
            # An edited curve row: its entries' hashes break too, for every charge that shares it; this names the row.
            report.flag(silo.id, None, f"charge {charge.id}'s curve (row {charge.curve_hash[:12]}… of the curves table) "
                        "does not hash to its key: the row was edited", charge.id)
        curve = _stored_curve(charge)
        if curve is None:
            # Left out of the recomputed sums, so the running sums are reported as well.
            report.flag(
                silo.id, None, f"charge {charge.id} has an RDP vector that does not parse as {len(rdp.ORDERS)} numbers", charge.id
            )
            continue
        residue += 4 * np.spacing(np.abs(np.where(np.isfinite(curve), curve, 0.0)))
        if logged in (ChargeStatus.reserved, ChargeStatus.committed):
            spent = spent.add(curve)
        if logged is ChargeStatus.committed:
            committed = committed.add(curve)
    for name, text, recomputed in (("spent", silo.rdp_spent, spent), ("committed", silo.rdp_committed, committed)):
        try:
            stored = RunningSum.from_json(text)
            same = (stored.finite.shape == recomputed.finite.shape == stored.infinite.shape
                    and np.array_equal(stored.infinite, recomputed.infinite)
                    and bool(np.all(np.abs(stored.finite - recomputed.finite)
                                    <= 1e-12 + residue + 1e-9 * np.abs(recomputed.finite))))
        except (ValueError, TypeError, KeyError):  # an edited sum that no longer parses: a finding, not a crash
            same = False
        if not same:
            report.flag(silo.id, None, f"the running {name} RDP sum differs from the sum of its charges")


def _stored_curve(charge: Charge) -> np.ndarray | None:
    try:
        curve = curve_from_json(charge.rdp)
    except (ValueError, TypeError):  # json's decode error is a ValueError
        return None
    return curve if curve.shape == (len(rdp.ORDERS),) else None
