"""A silo's history: its entries in order, each with the ε the ledger stated after it (the gate's
reading, what the ledger charges) and, for reference only, dp-accounting's non-adaptive RDP ε of
the same charges (best order, the whole δ), replayed from the charges' own curves.

The reference is not stored: it is recomputed here so that no column can make the two disagree.
Replaying costs one light row (event, curve) per earlier entry, and the conversions of the entries
shown are made a block at a time (rdp.epsilons; dp-accounting's own takes ~0.6 ms a curve).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sqlalchemy.orm import Session

from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_from_json
from dpledger.service.ledger import silos
from dpledger.service.store import records
from dpledger.service.store.models import Charge, EntryEvent, LedgerEntry, Silo


@dataclass(frozen=True)
class HistoryRow:
    entry: LedgerEntry
    charge: Charge | None
    epsilon_dp_accounting: float | None  # reference; None where a stored curve no longer parses


class _Replay:
    """The reserved + committed RDP sum, entry by entry: a reserve adds its charge, a release takes it
    back, a commit changes nothing (the charge was already spent when it was reserved)."""

    def __init__(self) -> None:
        self.running: RunningSum | None = RunningSum.empty(len(rdp.ORDERS))

    def step(self, event: EntryEvent, curve_json: str | None) -> None:
        if self.running is None or curve_json is None or event not in (EntryEvent.reserve, EntryEvent.release):
            return
        try:
            curve = curve_from_json(curve_json)
        except (ValueError, TypeError):
            curve = np.empty(0)
        if curve.shape != (len(rdp.ORDERS),):  # an edited row: the history still shows, without a reference
            self.running = None
            return
        self.running = self.running.add(curve) if event is EntryEvent.reserve else self.running.subtract(curve)


_BLOCK = 4096  # rows converted at once: 4,096 × 156 orders of float64 is 5 MB


def dp_accounting_epsilon(silo: Silo) -> float:
    """For reference: dp-accounting's non-adaptive RDP ε of the silo's reserved + committed charges."""
    return rdp.epsilon(RunningSum.from_json(silo.rdp_spent).curve(), delta=silo.delta)[0]


def history(session: Session, silo_id: int, *, after_seq: int = 0, limit: int = 10_000) -> list[HistoryRow]:
    silo = silos.get(session, silo_id, checked=False)  # readable while tampered: it is how an admin inspects one
    replay = _Replay()
    if after_seq > 0:
        for event, curve_json in records.reserve_release_curves(session, silo_id, through_seq=after_seq):
            replay.step(event, curve_json)
    rows = records.entries_after(session, silo_id, after_seq=after_seq, limit=limit)
    out: list[HistoryRow] = []
    for start in range(0, len(rows), _BLOCK):  # a block of sums converted at once, so memory stays bounded
        block = rows[start:start + _BLOCK]
        sums = []
        for entry, charge in block:
            replay.step(entry.event, None if charge is None else charge.rdp)
            sums.append(None if replay.running is None else replay.running.curve())
        known = [curve for curve in sums if curve is not None]
        converted = iter(rdp.epsilons(np.vstack(known), delta=silo.delta).tolist() if known else [])
        out += [HistoryRow(entry, charge, None if curve is None else next(converted))
                for (entry, charge), curve in zip(block, sums, strict=True)]
    return out
