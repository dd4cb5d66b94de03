"""The silo columns that its chain decides, recomputed from the chain: the running sums, the place on
its plan, the seqs of its filter, plan, seal and retire entries, and the chain's end (chain_seq,
chain_head). No hash covers them as stored; each is a function of the entries and of the charges
whose hashes they carry, so `seals.check` compares the row with what this module derives from those,
at every load, and names an edited column (409) before anything is approved on it.

Derived once per process and kept by the chain's end (seq, head), which fixes every entry before it:
an approval extends what it checked by its own entry (`extend`, no parse, no hash); entries written
since by another process are replayed from the rows the record check's one statement reads already
(`seq > since`), each charge entry's hash recomputed first; a process that holds nothing for a silo
replays its whole chain once, in pages (`cold`). Pure apart from `cold`'s reads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dpledger.service.accounting import plans, rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_from_json
from dpledger.service.ledger import chain
from dpledger.service.store.models import ChargeRecord, EntryEvent, Silo, SiloRecord
from dpledger.service.store.reserving import CHARGE_COLUMNS
from dpledger.wire.mechanisms import AnyMechanism, Mechanism

# A plan text progress was derived under: NO_PLAN where nothing tracked the reserves for a plan.
NO_PLAN = "\x00no plan"


@dataclass(frozen=True, slots=True)
class State:
    """What a silo's chain through entry `seq` (hash `head`) makes of its record."""

    seq: int
    head: str
    event: EntryEvent  # entry `seq`'s
    spent: RunningSum
    committed: RunningSum
    texts: tuple[str, str] | None  # the row's (rdp_spent, rdp_committed) texts known to read as spent, committed
    charged: bool  # a reserve entry is in the chain
    filter_seq: int | None  # the newest filter entry
    plan_seq: int | None  # the plan entry
    sealed_seq: int | None  # the newest seal entry
    retired_seq: int | None  # the (first) retire entry
    plan_basis: str | None  # the plan text plan_used/ended were folded under (None: any; NO_PLAN: untracked)
    plan_used: int
    plan_ended_seq: int | None
    unfolded: tuple[tuple[int, str], ...]  # reserves (seq, mechanism JSON) not yet folded into the plan


def genesis(*, track_plan: bool) -> State:
    empty = RunningSum.empty(len(rdp.ORDERS))
    return State(0, chain.GENESIS, EntryEvent.create, empty, empty, None, False, None, None, None, None,
                 None if track_plan else NO_PLAN, 0, None, ())


class Broken(Exception):
    """The chain itself does not replay: an entry that does not link, or does not match its hash."""

    def __init__(self, seq: int, event: Any, why: str) -> None:
        super().__init__(why)
        self.seq, self.event, self.why = seq, event, why


def _charge(row: Any) -> ChargeRecord:
    return ChargeRecord(**{column: getattr(row, f"c_{column}") for column in CHARGE_COLUMNS})


def advance(state: State, rows: Iterable[Any], *, silo_id: int) -> State:
    """`state` extended by these entries (rows of the ledger_entries columns and `c_*` charge columns, in
    seq order). Raises Broken where an entry does not follow `state` or its charge's hash fails."""
    for row in rows:
        if row.seq != state.seq + 1 or row.prev_hash != state.head:
            raise Broken(row.seq, row.event, f"has entry {row.seq}, which does not follow entry {state.seq} of its chain")
        event = row.event
        if not isinstance(event, EntryEvent):
            raise Broken(row.seq, event, f"has entry {row.seq} with an unknown event {event!r}")
        if event in (EntryEvent.reserve, EntryEvent.commit, EntryEvent.release):
            state = _charge_step(state, row, event, silo_id=silo_id)
        elif row.charge_id is not None:
            raise Broken(row.seq, event, f"has entry {row.seq}, a {event.value} entry that names charge {row.charge_id}")
        elif event is EntryEvent.filter:
            state = replace(state, filter_seq=row.seq)
        elif event is EntryEvent.plan:
            # Progress starts at the plan's entry (a plan is declared before any charge).
            state = replace(state, plan_seq=row.seq, plan_basis=None, plan_used=0, plan_ended_seq=None, unfolded=())
        elif event is EntryEvent.seal:
            state = replace(state, sealed_seq=row.seq)
        elif event is EntryEvent.retire and state.retired_seq is None:
            state = replace(state, retired_seq=row.seq)
        state = replace(state, seq=row.seq, head=row.hash, event=event)
    return state


def _charge_step(state: State, row: Any, event: EntryEvent, *, silo_id: int) -> State:
    if row.charge_id is None or row.c_id is None:
        raise Broken(row.seq, event, f"has entry {row.seq}, a {event.value} entry whose charge {row.charge_id} is gone")
    charge = _charge(row)
    if charge.silo_id != silo_id or chain.entry_hash(row, subject=chain.charge_fields(charge)) != row.hash:
        raise Broken(row.seq, event, f"has entry {row.seq} ({event.value} of charge {charge.id}), which no longer matches "
                                     "its hash")
    try:
        curve = curve_from_json(charge.rdp)
        if curve.shape != (len(rdp.ORDERS),):
            raise ValueError
    except (ValueError, TypeError):
        raise Broken(row.seq, event, f"has entry {row.seq}, whose charge {charge.id}'s curve does not parse") from None
    if event is EntryEvent.reserve:
        unfolded = state.unfolded
        if state.plan_basis != NO_PLAN and state.plan_ended_seq is None:
            unfolded = (*unfolded, (row.seq, charge.mechanism))
        return replace(state, spent=state.spent.add(curve), texts=None, charged=True, unfolded=unfolded)
    if event is EntryEvent.commit:
        return replace(state, committed=state.committed.add(curve), texts=None)
    return replace(state, spent=state.spent.subtract(curve), texts=None)


def extend(state: State, silo: Silo | SiloRecord, *, event: EntryEvent, before: tuple[str, str]) -> State | None:
    """`state` (the chain through the silo's previous entry, found sound in this transaction) after the
    entry the ledger just wrote, from what it wrote: its sums are the replay's own arithmetic on the same
    values where the row read exactly as `state` before (`before`: its texts then), and its place on the
    plan gate.take's from the same. None where that cannot be told without a replay (the next check
    replays the entry)."""
    if state.texts != before:
        return None
    spent, committed = RunningSum.from_json(silo.rdp_spent), RunningSum.from_json(silo.rdp_committed)  # kept parsed
    new = replace(state, seq=silo.chain_seq, head=silo.chain_head, event=event, spent=spent, committed=committed,
                  texts=(silo.rdp_spent, silo.rdp_committed))
    if event is EntryEvent.reserve:
        new = replace(new, charged=True)
        if state.plan_basis != NO_PLAN:
            if state.plan_basis != silo.plan or state.unfolded:
                return None
            new = replace(new, plan_used=silo.plan_used, plan_ended_seq=silo.plan_ended_seq)
    elif event is EntryEvent.filter:
        new = replace(new, filter_seq=silo.chain_seq)
    elif event is EntryEvent.plan:
        new = replace(new, plan_seq=silo.chain_seq, plan_basis=silo.plan, plan_used=0, plan_ended_seq=None, unfolded=())
    elif event is EntryEvent.seal:
        new = replace(new, sealed_seq=silo.chain_seq)
    elif event is EntryEvent.retire and state.retired_seq is None:
        new = replace(new, retired_seq=silo.chain_seq)
    return new


_MECHANISM: Any = None


def _mechanism(text: str) -> AnyMechanism:
    global _MECHANISM
    if _MECHANISM is None:
        from pydantic import TypeAdapter
        _MECHANISM = TypeAdapter(Mechanism)
    mechanism: AnyMechanism = _MECHANISM.validate_json(text)
    return mechanism


def fold_plan(state: State, plan_text: str | None) -> State | None:
    """`state` with its reserves folded into its place on the plan `plan_text` (the row's, its hash
    checked), as gate.take placed them; None where the reserves since the plan were not kept (a plan the
    row holds that nothing tracked: the chain is replayed from its start)."""
    if plan_text is None:
        return replace(state, unfolded=())
    if state.plan_basis == NO_PLAN or (state.plan_basis not in (None, plan_text)):
        return None
    declared = plans.Plan.from_json(plan_text)
    used, ended = state.plan_used, state.plan_ended_seq
    for seq, mechanism in state.unfolded:
        if ended is not None:
            break
        try:
            units = plans.segments(_mechanism(mechanism))
        except ValueError:  # its hash was checked: a mechanism the ledger wrote and no longer reads
            ended = seq
            break
        taken = plans.follows(declared, used=used, charge=units)
        if taken is None:
            ended = seq
        else:
            used += taken
    return replace(state, plan_basis=plan_text, plan_used=used, plan_ended_seq=ended, unfolded=())


def sums_differ(state: State, spent_text: str, committed_text: str) -> list[str]:
    """The running sums of the row that do not read as the chain's (within the tolerance of the audit's
    check: a ledger older than the ledger's present arithmetic may differ in the last digits)."""
    if state.texts == (spent_text, committed_text):
        return []
    differ = []
    for name, text, derived in (("rdp_spent", spent_text, state.spent), ("rdp_committed", committed_text, state.committed)):
        try:
            stored = RunningSum.from_json(text)
            same = (stored.finite.shape == derived.finite.shape and np.array_equal(stored.infinite, derived.infinite)
                    and bool(np.allclose(stored.finite, derived.finite, rtol=1e-9, atol=1e-12)))
        except (ValueError, TypeError, KeyError):
            same = False
        if not same:
            differ.append(name)
    return differ


def first_difference(state: State, silo: Silo | SiloRecord) -> tuple[str, int, EntryEvent] | None:
    """The first column of the row's chain-decided seqs that is not what the chain makes it, as (why,
    the entry to name, its event), or None."""
    if silo.retired_seq != state.retired_seq:
        if state.retired_seq is not None:
            return (f"says it is {'in service' if silo.retired_seq is None else f'retired at entry {silo.retired_seq}'}, "
                    f"but entry {state.retired_seq} retired it", state.retired_seq, EntryEvent.retire)
        return (f"says it was retired at entry {silo.retired_seq}, but no retire entry of its chain is there",
                silo.retired_seq or 0, EntryEvent.retire)
    if silo.sealed_seq != state.sealed_seq:
        return (f"says it was sealed at entry {silo.sealed_seq}, but its chain's newest seal is "
                f"{'none' if state.sealed_seq is None else f'entry {state.sealed_seq}'}",
                *((state.sealed_seq, EntryEvent.seal) if state.sealed_seq is not None else (state.seq, state.event)))
    if silo.filter_seq == 0 and (state.filter_seq is not None or state.charged or state.sealed_seq is not None):
        if state.filter_seq is not None:
            return ("says its filter is still to be fixed by its first charge, but this entry fixed it",
                    state.filter_seq, EntryEvent.filter)
        return ("says its filter is still to be fixed by its first charge, but its chain holds charges",
                state.seq, state.event)
    if silo.filter_seq == 1 and state.filter_seq is not None:  # a refit filter put back to the registered one
        return ("says its filter is the one its create entry covers, but this entry fixed another",
                state.filter_seq, EntryEvent.filter)
    if silo.filter_seq not in (0, 1) and silo.filter_seq != state.filter_seq:
        return (f"says its filter is at entry {silo.filter_seq}, but its chain's filter entry is "
                f"{'none' if state.filter_seq is None else f'entry {state.filter_seq}'}",
                *((state.filter_seq, EntryEvent.filter) if state.filter_seq is not None else (state.seq, state.event)))
    if silo.plan is None and state.plan_seq is not None:
        return ("holds no plan, but this entry declared one", state.plan_seq, EntryEvent.plan)
    return None


def plan_differs(state: State, silo: Silo | SiloRecord) -> str | None:
    if silo.plan is None or (silo.plan_used, silo.plan_ended_seq) == (state.plan_used, state.plan_ended_seq):
        return None
    return (f"says its place on its plan is {silo.plan_used} units taken, branch ended at entry {silo.plan_ended_seq}, "
            f"where its charges make it {state.plan_used} units taken, branch ended at entry {state.plan_ended_seq}")


def rows_after(rows: Sequence[Any], since: int) -> list[Any]:
    return sorted((row for row in rows if row.seq > since), key=lambda row: row.seq)
