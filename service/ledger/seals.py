"""A silo's stored record checked against the entries whose hashes cover it, each time it is loaded.

The budget, δ, dataset size, relation, filter and plan live on the silo row, and the gate reads them
from there. Each is covered by the hash of one entry of the silo's chain (create, filter, plan):
recomputing those one to three hashes costs one or two indexed reads, so every request that loads the
silo can afford it, and an edited row is named (a 409 saying which record and which entry) before
anything parses it or approves against it, instead of a 500 or an approval under a forged budget.

Resolution: an admin who inspected the silo either restores the row (the hashes recompute again and
the silo answers as before) or seals the record as it stands: a `seal` entry in the silo's chain and
in the transparency log, whose hash covers the whole record from then on. The seal does not hide the
edit: the create entry's leaf still no longer matches its record, which every silo's `verify
--receipts` and every auditor's `audit` go on reporting.
"""

from __future__ import annotations

import functools
import math
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Label, Select, bindparam, select
from sqlalchemy.orm import Session

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans
from dpledger.service.ledger import chain, gate
from dpledger.service.ledger.db import Database
from dpledger.service.ledger.errors import Conflict
from dpledger.service.ledger.models import EntryEvent, LedgerEntry, Silo

# The events whose entries cover the silo's record rather than a charge.
RECORD_EVENTS = (EntryEvent.create, EntryEvent.filter, EntryEvent.plan, EntryEvent.seal, EntryEvent.retire)

_TABLE = LedgerEntry.__table__
# Built once (every approval runs it), with a fixed list of seqs rather than an expanding one, which
# would be rendered again at each execution: a record is covered by at most three entries (its
# create or seal entry, its filter entry, its retire entry), and a shorter list repeats its first.
_COVERING_AT_MOST = 3
_ENTRIES_AT = select(*_TABLE.c).where(
    _TABLE.c.silo_id == bindparam("silo_id"),
    _TABLE.c.seq.in_([bindparam(f"seq{i}") for i in range(_COVERING_AT_MOST)]),
)


class Tampered(Conflict):
    """The silo's row no longer recomputes to the hash of the entry that covers it."""

    def __init__(self, *, silo_id: int, seq: int, event: EntryEvent, why: str) -> None:
        super().__init__(
            f"silo {silo_id}'s record (the silos row) {why}: its {event.value} entry (seq {seq}) covers it. "
            f"Nothing is approved on this silo until an admin inspects it, then restores the row or seals it "
            f"as it stands (POST /v1/silos/{silo_id}/seal); GET /v1/audit/verify names every broken entry"
        )
        self.silo_id = silo_id
        self.seq = seq
        self.event = event


@functools.cache
def _entries_and(column: Label[Any] | None) -> Select[Any]:
    return _ENTRIES_AT if column is None else _ENTRIES_AT.add_columns(column)


def covering(
    session: Session, silo: Silo, *, also: tuple[Label[Any], dict[str, Any]] | None = None,
) -> tuple[list[tuple[EntryEvent, int, LedgerEntry | None]], Any]:
    """The entries that cover the silo's record now, as (event, seq, the entry or None if gone), and
    the value of `also` (a scalar column and its parameters) read in the same statement: None where
    no covering entry was found, which `check` refuses before anyone reads it."""
    wanted: dict[int, EntryEvent] = {}
    if silo.sealed_seq is not None:
        wanted[silo.sealed_seq] = EntryEvent.seal
    else:
        wanted[1] = EntryEvent.create
        if silo.filter_seq not in (1, gate.PENDING_SEQ):  # a pending silo's filter is covered by no entry yet
            wanted[silo.filter_seq] = EntryEvent.filter
    if silo.retired_seq is not None:
        # Last, so that a retired_seq moved onto another record entry is read as a retire entry there and
        # refused (the entry it names is no retire entry), never as that entry's own.
        wanted[silo.retired_seq] = EntryEvent.retire
    # Core rows (they carry an entry's attributes, all that a hash reads): every approval makes this read.
    seqs = list(wanted)
    column, extra = also if also is not None else (None, {})
    rows = session.connection().execute(_entries_and(column), {
        **extra, "silo_id": silo.id, **{f"seq{i}": seqs[min(i, len(seqs) - 1)] for i in range(_COVERING_AT_MOST)},
    }).all()
    found = {e.seq: cast(LedgerEntry, e) for e in rows}
    value = rows[0][-1] if column is not None and rows else None
    out = [(event, seq, found.get(seq)) for seq, event in sorted(wanted.items())]
    if silo.plan is not None:
        # A plan is declared before any charge, so its entry is among the silo's first: the scan in
        # seq order along the (silo_id, seq) index stops there. One declared after a seal is not covered by it.
        plan_entry = session.scalars(
            select(LedgerEntry).where(LedgerEntry.silo_id == silo.id, LedgerEntry.event == EntryEvent.plan,
                                      LedgerEntry.seq > (silo.sealed_seq or 0)).order_by(LedgerEntry.seq).limit(1)
        ).first()
        if plan_entry is not None or silo.sealed_seq is None:
            out.append((EntryEvent.plan, 0 if plan_entry is None else plan_entry.seq, plan_entry))
    return out, value


# What `check` found sound, by every value its hash reads (the entry's columns, the record's fields):
# an approval reads the same silo record and entries as the one before, and recomputing their
# hashes re-encodes the silo's filter each time. Emptied at this size.
_SOUND_LIMIT = 1024  # keys hold the record's texts (its filter: a few kB), so at most a few MB
_SOUND: set[tuple[object, ...]] = set()


def _exactly(*values: object) -> tuple[object, ...]:
    """A key equal only for values that encode alike: 1 == 1.0 == True and 0.0 == -0.0 in Python, not
    in the JSON a hash reads (SQLite may hand back a REAL where an INTEGER was stored, if edited)."""
    return tuple((type(v), v.hex() if isinstance(v, float) else v) for v in values)


def check(session: Session, silo: Silo, *, also: tuple[Label[Any], dict[str, Any]] | None = None) -> Any:
    """Raises Tampered unless every entry that covers the silo's record recomputes to its hash.
    Returns the value of `also`, read with the entries (see `covering`), once the record is sound."""
    entries, value = covering(session, silo, also=also)
    for event, seq, entry in entries:
        if entry is None:
            raise Tampered(silo_id=silo.id, seq=seq, event=event, why="is covered by no entry: the entry was removed")
        if entry.event != event:
            raise Tampered(silo_id=silo.id, seq=seq, event=event,
                           why=f"is covered by entry {seq}, which now reads as a {entry.event!s} entry")
        subject = chain.subject(event, silo, None)
        read = _exactly(entry.silo_id, entry.seq, entry.event, entry.charge_id, entry.epsilon_spent, entry.created_at,
                        entry.prev_hash, entry.hash, *subject.keys(), *subject.values())
        if read in _SOUND:
            continue
        if chain.entry_hash(entry, subject=subject) != entry.hash:
            raise Tampered(silo_id=silo.id, seq=seq, event=event, why="no longer matches the hash of the entry that covers it")
        if len(_SOUND) >= _SOUND_LIMIT:
            _SOUND.clear()
        _SOUND.add(read)
    if silo.sealed_seq is None and gate.pending(silo):
        # A record that says its first charge is still to fix its filter must hold no filter entry:
        # else an edit back to pending would let the next charge fix another filter over a spent sum.
        fixed = session.scalars(select(LedgerEntry.seq).where(
            LedgerEntry.silo_id == silo.id, LedgerEntry.event == EntryEvent.filter).limit(1)).first()
        if fixed is not None:
            raise Tampered(silo_id=silo.id, seq=fixed, event=EntryEvent.filter,
                           why="says its filter is still to be fixed by its first charge, but this entry fixed it")
    return value


def sealable(silo: Silo) -> None:
    """A record may be sealed only if the gate can read it: else sealing would trade a 409 for a 500."""
    problems = []
    if gate.pending(silo):
        # The seal's hash covers the record as it stands, filter included, and the first charge would
        # then fix another filter under it: the row must be restored instead (nothing is spent yet).
        problems.append("its filter is still to be fixed by its first charge, which a seal would forbid")
    if not (math.isfinite(silo.epsilon) and silo.epsilon > 0):
        problems.append(f"epsilon={silo.epsilon!r} is not a positive finite number")
    if not (math.isfinite(silo.delta) and 0 < silo.delta < 1):
        problems.append(f"delta={silo.delta!r} is not in (0, 1)")
    try:
        rdp_filter.FilterSpec.from_json(silo.filter_spec)
    except (ValueError, TypeError, KeyError) as error:
        problems.append(f"its filter does not parse ({error})")
    if silo.plan is not None:
        try:
            plans.Plan.from_json(silo.plan)
        except (ValueError, TypeError, KeyError) as error:
            problems.append(f"its plan does not parse ({error})")
    if problems:
        raise Conflict(f"silo {silo.id}'s record cannot be sealed as it stands: {'; '.join(problems)}. Restore the row first")


def seal(db: Database, silo_id: int) -> int:
    """Seals a tampered silo's record as it stands, in a `seal` entry of its chain and of the
    transparency log, so that approvals resume; returns the entry's seq. A 409 if nothing is broken
    (there is nothing to accept) or if the record cannot be read (it must be restored instead)."""
    from dpledger.service.ledger import silos  # silos loads through this module: imported here, not above

    with db.write() as session:
        silo = silos.lock(session, silo_id, checked=False)
        # A retired silo approves nothing, so a seal (which exists to resume approvals) has nothing to
        # resume; its edited row is restored instead. Checked first: the answer names the retirement.
        silos.refuse_if_retired(silo)
        try:
            check(session, silo)
        except Tampered:
            pass
        else:
            raise Conflict(f"silo {silo_id}'s record matches the hashes of its entries: there is nothing to seal")
        sealable(silo)
        position = silos.append_entry(session, silo, event=EntryEvent.seal, charge=None,
                                      epsilon_spent=silos.epsilon_spent(silo), now=datetime.now(UTC))
        silo.sealed_seq = position.seq
        return position.seq
