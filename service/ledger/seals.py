"""A silo's stored record checked, each time it is loaded, against the chain of entries that covers it.

The gate reads every column of the silo row (COVERAGE below), and each is sound in one of two ways:
- a stored field (budget, δ, dataset size, relation, filter, plan, retirement reason, ...) is covered by
  the hash of one entry of the silo's chain (create, filter, plan, seal, retire): recomputing those few
  hashes costs one indexed read, so every request that loads the silo can afford it;
- a column the chain decides (running sums, the place on the plan, the seqs of its filter, plan, seal
  and retire entries, the chain's end) is recomputed from the chain's entries and their charges
  (replayed.py), kept per process by the chain's end and extended by each approval, in the same read.
An edited row is named (a 409 saying which record and which entry) before anything parses it or
approves against it, instead of a 500 or an approval under a forged budget.

Resolution: an admin who inspected the silo either restores the row (the hashes recompute again and
the silo answers as before) or, for a stored field, seals the record as it stands: a `seal` entry in
the silo's chain and in the transparency log, whose hash covers the whole record from then on. The
seal does not hide the edit: the create entry's leaf still no longer matches its record, which every
silo's `verify --receipts` and every auditor's `audit` go on reporting. A column the chain decides is
never sealed: it is restored (its right value is in the 409).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy.orm import Session

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans
from dpledger.service.ledger import chain, gate, replayed
from dpledger.service.ledger.errors import Conflict
from dpledger.service.store import reserving
from dpledger.service.store.db import Database, database_url
from dpledger.service.store.models import EntryEvent, LedgerEntry, Silo, SiloRecord

# The events whose entries cover the silo's record rather than a charge.
RECORD_EVENTS = (EntryEvent.create, EntryEvent.filter, EntryEvent.plan, EntryEvent.seal, EntryEvent.retire)

# Every column of the silos table, and what keeps an approval from reading it edited (a test holds the
# table to this list). HASHED: the entries whose hash covers the field as stored (chain.py).
HASHED: dict[str, tuple[EntryEvent, ...]] = {
    "id": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "name": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "epsilon": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "delta": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "dataset_size": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "relation": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "created_at": (EntryEvent.create, EntryEvent.seal, EntryEvent.retire),
    "filter_spec": (EntryEvent.create, EntryEvent.filter, EntryEvent.seal),
    "registered_filter": (EntryEvent.create, EntryEvent.seal),
    "plan": (EntryEvent.plan, EntryEvent.seal),
    "retired_reason": (EntryEvent.retire,),
}
# RECOMPUTED: the columns the chain decides, replayed from its entries and their charges (replayed.py).
RECOMPUTED: dict[str, str] = {
    "rdp_spent": "the curves of the charges reserved and not released, in chain order",
    "rdp_committed": "the curves of the committed charges, in chain order",
    "chain_seq": "the seq of the chain's last entry",
    "chain_head": "the hash of the chain's last entry",
    "filter_seq": "the seq of the filter entry; else 1 or 0, which decides whether the create entry's hash covers the filter",
    "plan_used": "the plan's units the reserves after the plan entry took (gate.take)",
    "plan_ended_seq": "the reserve entry whose charge left the plan (gate.take)",
    "sealed_seq": "the seq of the newest seal entry",
    "retired_seq": "the seq of the retire entry",
}
# UNREAD: columns that decide no approval, each with why (none today).
UNREAD: dict[str, str] = {}

class Tampered(Conflict):
    """The silo's row no longer recomputes to the hash of the entry that covers it, or no longer reads
    as its chain makes it (`recomputed`: a column that no hash covers as stored, replayed.py)."""

    def __init__(self, *, silo_id: int, seq: int, event: EntryEvent, why: str, recomputed: bool = False) -> None:
        covers = "decides" if recomputed else "covers"
        super().__init__(
            f"silo {silo_id}'s record (the silos row) {why}: its {event.value} entry (seq {seq}) {covers} it. "
            f"Nothing is approved on this silo until an admin inspects it, then restores the row"
            + ("" if recomputed else f" or seals it as it stands (POST /v1/silos/{silo_id}/seal)")
            + "; GET /v1/audit/verify names every broken entry"
        )
        self.silo_id = silo_id
        self.seq = seq
        self.event = event
        self.why = why
        self.recomputed = recomputed


# What this process derived of each silo's chain (replayed.State), by engine and silo: any process's
# write moves the chain's end, and an edit of the row is compared against it, never adopted.
_DERIVED_LIMIT = 4096
_DERIVED: dict[tuple[object, int], replayed.State] = {}


def _key(session: Session, silo_id: int) -> tuple[object, int]:
    # By the database's URL; the chain's end validates what is kept in any case.
    return database_url(session), silo_id


def derived(session: Session, silo: Silo | SiloRecord) -> replayed.State | None:
    """This process's state of the silo's chain through its current end, if it holds it (for `extend`)."""
    state = _DERIVED.get(_key(session, silo.id))
    return state if state is not None and (state.seq, state.head) == (silo.chain_seq, silo.chain_head) else None


def keep(session: Session, silo_id: int, state: replayed.State | None) -> None:
    key = _key(session, silo_id)
    if state is None:
        _DERIVED.pop(key, None)
        return
    if len(_DERIVED) >= _DERIVED_LIMIT:
        _DERIVED.clear()
    _DERIVED[key] = state


def _event(value: Any) -> EntryEvent:
    # A Tampered names an entry by its event; an edited event that is no member names it as the
    # record's create entry would not, so it is named as the charge event it most likely was.
    return value if isinstance(value, EntryEvent) else EntryEvent.reserve


def _replay(session: Session, silo: Silo | SiloRecord, rows: Sequence[Any]) -> tuple[replayed.State, dict[int, Any]]:
    """The chain's state through its end, from this process's (and `rows`, the entries after it), or
    replayed from the start; and the record entries a cold replay read (the covering ones among them)."""
    kept = _DERIVED.get(_key(session, silo.id))
    if kept is not None and kept.seq <= silo.chain_seq:
        try:
            state = replayed.advance(kept, replayed.rows_after(rows, kept.seq), silo_id=silo.id)
        except replayed.Broken:
            pass  # kept from a transaction that rolled back, say: the chain is replayed from its start
        else:
            if (state.seq, state.head) == (silo.chain_seq, silo.chain_head):
                return state, {}
    state, seen = replayed.genesis(track_plan=silo.plan is not None), {}
    while True:
        page = reserving.entries_after(session, silo_id=silo.id, since=state.seq)
        try:
            state = replayed.advance(state, page, silo_id=silo.id)
        except replayed.Broken as broken:
            raise Tampered(silo_id=silo.id, seq=broken.seq, event=_event(broken.event),
                           why=f"is not what its chain makes it: the chain {broken.why}", recomputed=True) from None
        seen.update({row.seq: row for row in page if row.event in RECORD_EVENTS})
        if len(page) < reserving.PAGE:
            return state, seen


def covering(
    session: Session, silo: Silo | SiloRecord, *, key: reserving.AfterLock | None = None,
) -> tuple[list[tuple[EntryEvent, int, LedgerEntry | None]], int | None, replayed.State]:
    """The entries that cover the silo's record now, as (event, seq, the entry or None if gone), the
    charge `key` names, read in the same statement (store/reserving.py says why there; None
    where no entry was read, which `check` refuses before anyone reads it), and the chain's state through
    its end (replayed.py). One statement where this process holds the chain's end or a recent one."""
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
    kept = _DERIVED.get(_key(session, silo.id))
    since = kept.seq if kept is not None and kept.seq <= silo.chain_seq else silo.chain_seq
    seqs = [*wanted, *([kept.plan_seq] if kept is not None and kept.plan_seq is not None else [])]
    rows, earlier = reserving.covering_entries(
        session, silo_id=silo.id, seqs=seqs, since=since, key=key)
    state, seen = _replay(session, silo, rows)
    if (state.seq, state.head) != (silo.chain_seq, silo.chain_head):
        why = (f"ends its chain at entry {silo.chain_seq}, but its chain's last entry is entry {state.seq}"
               + (" (the record was rolled back)" if state.seq > silo.chain_seq else "")
               if state.seq != silo.chain_seq else
               f"names {silo.chain_head[:16]}… as the hash of its chain's last entry, entry {state.seq}, whose hash is "
               f"{state.head[:16]}…")
        raise Tampered(silo_id=silo.id, seq=state.seq, event=state.event, recomputed=True, why=why)
    found = {**seen, **{row.seq: cast(LedgerEntry, row) for row in rows}}
    out = [(event, seq, found.get(seq)) for seq, event in sorted(wanted.items())]
    if silo.plan is not None:
        # A plan declared after a seal is not covered by it; one declared before, by the seal.
        if state.plan_seq is not None and state.plan_seq > (silo.sealed_seq or 0):
            out.append((EntryEvent.plan, state.plan_seq, found.get(state.plan_seq)))
        elif state.plan_seq is None and silo.sealed_seq is None:
            out.append((EntryEvent.plan, 0, None))
    return out, earlier, state


# What `check` found sound, by every value its hash reads (the entry's columns, the record's fields):
# an approval reads the same silo record and entries as the one before, and recomputing their
# hashes re-encodes the silo's filter each time. Emptied at this size.
_SOUND_LIMIT = 1024  # keys hold the record's texts (its filter: a few kB), so at most a few MB
_SOUND: set[tuple[object, ...]] = set()


def _exactly(*values: object) -> tuple[object, ...]:
    """A key equal only for values that encode alike: 1 == 1.0 == True and 0.0 == -0.0 in Python, not
    in the JSON a hash reads (SQLite may hand back a REAL where an INTEGER was stored, if edited)."""
    return tuple((type(v), v.hex() if isinstance(v, float) else v) for v in values)


def check(session: Session, silo: Silo | SiloRecord, *, key: reserving.AfterLock | None = None) -> int | None:
    """Raises Tampered unless every column of the silo's record that an approval reads is sound: each
    stored field recomputes to the hash of the entry that covers it, and each column its chain decides
    is what the chain makes it (replayed.py; COVERAGE says which is which). Returns the id of the charge
    `key` names, read with the entries (see `covering`), once the record is sound."""
    entries, earlier, state = covering(session, silo, key=key)
    differs = replayed.first_difference(state, silo)
    if differs is not None:
        why, seq, event = differs
        raise Tampered(silo_id=silo.id, seq=seq, event=event, why=why, recomputed=True)
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
    # The plan's text is sound now (its entry's hash, or the seal's): its place on it can be replayed.
    folded = replayed.fold_plan(state, silo.plan)
    if folded is None:  # the reserves a plan that came with a seal places were not kept: from the start
        keep(session, silo.id, None)
        _, earlier, state = covering(session, silo, key=key)
        folded = replayed.fold_plan(state, silo.plan)
        assert folded is not None, "a replay from the start keeps every reserve of a silo with a plan"
    state = folded
    plan_why = replayed.plan_differs(state, silo)
    if plan_why is not None:
        named = (EntryEvent.plan, state.plan_seq) if state.plan_seq is not None else (EntryEvent.seal, silo.sealed_seq or 0)
        raise Tampered(silo_id=silo.id, seq=named[1], event=named[0], why=plan_why, recomputed=True)
    differ = replayed.sums_differ(state, silo.rdp_spent, silo.rdp_committed)
    if differ:
        raise Tampered(silo_id=silo.id, seq=state.seq, event=state.event, recomputed=True,
                       why=f"holds {' and '.join(differ)} that the charges of its chain through entry {state.seq} "
                           "do not add up to")
    keep(session, silo.id, replace(state, texts=(silo.rdp_spent, silo.rdp_committed)))
    return earlier


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
        except Tampered as tampered:
            if tampered.recomputed:  # a seal accepts stored fields; these its chain decides, whatever is stored
                raise Conflict(f"silo {silo_id}'s record cannot be sealed as it stands: it {tampered.why}, a column its "
                               "chain decides, which no seal may accept. Restore the row first") from None
        else:
            raise Conflict(f"silo {silo_id}'s record matches the hashes of its entries: there is nothing to seal")
        sealable(silo)
        position = silos.append_entry(session, silo, event=EntryEvent.seal, charge=None,
                                      epsilon_spent=silos.epsilon_spent(silo), now=datetime.now(UTC))
        silo.sealed_seq = position.seq
        return position.seq
