"""Every silo's ε recomposed from what the ledger signed: an auditor's replay of each silo's entries
in the transparency log, record by record as the log's pages arrive (`Replays`), or of one silo's
records at once (`compose_silo`). What each entry states (its ε, the budget and filter its record
entries fix) is checked against what the mechanisms of its charges compose to, read as the gate
reads it.

It imports the ledger's accounting (`dpledger.service.accounting`: pure math over dp-accounting, no
database, no HTTP), and nothing else of the service: an auditor's ε must be the gate's, computed by
the same functions, never by a copy of them that could drift. Inside the replay, not with the
module: every `dpledger` command loads this one, and only a replay needs dp-accounting and scipy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from dpledger.audit.outcome import Outcome
from dpledger.wire.chain_replay import ChainReplay, Link

EPSILON_RTOL = 1e-6  # the ledger's running sum and a fresh sum of the same curves differ by rounding only


class Replays:
    """One `_replay` per silo, fed each record as its page of the log arrives."""

    def __init__(self, out: Outcome) -> None:
        self.out = out
        self.running: dict[int, Generator[None, dict[str, Any] | None, Composition | None]] = {}
        self.ended: set[int] = set()

    def feed(self, record: dict[str, Any] | None, silo_id: int) -> None:
        if silo_id in self.ended:
            return
        replay = self.running.get(silo_id)
        if replay is None:
            replay = self.running[silo_id] = _replay(silo_id, self.out)
            next(replay)
        try:
            replay.send(record)
        except StopIteration as stop:
            self.ended.add(silo_id)
            if stop.value is not None:
                self.out.budgets[silo_id] = stop.value.budget

    def halt(self, silo_id: Any, where: str) -> None:
        """Ends `silo_id`'s replay where its record is not what the ledger signed (the entries after it
        would be read against an unknown one)."""
        if not isinstance(silo_id, int) or silo_id in self.ended:
            return
        self.ended.add(silo_id)
        replay = self.running.pop(silo_id, None)
        if replay is not None:
            replay.close()
        self.out.notes.append(f"silo {silo_id}: its ε is recomposed from its signed entries before {where} only: "
                              "the record served there is not what the ledger signed")

    def finish(self) -> None:
        for silo_id in list(self.running):
            self.feed(None, silo_id)


@dataclass(frozen=True)
class Composition:
    """A silo's promise as its signed entries fixed it, and the ε its charges' mechanisms compose to."""

    budget: float
    delta: float
    spec: Any  # accounting.filter.FilterSpec, or None for a silo from before filters
    record_event: str  # the entry that fixed them: "create", or "seal" where an admin sealed the record since
    epsilon: float  # after the silo's last entry
    retired_seq: int | None = None  # the seq of the silo's signed retire entry: it approves nothing after it


def same_epsilon(stated: float, composed: float) -> bool:
    return (math.isinf(composed) and math.isinf(stated)) or math.isclose(composed, stated, rel_tol=EPSILON_RTOL)


def compose_silo(silo_id: int, silo_records: list[dict[str, Any]], out: Outcome) -> Composition | None:
    """Replays one silo's entries, in the order of their seq (`_replay`)."""
    replay = _replay(silo_id, out)
    next(replay)
    try:
        # A seq that is not a number (a hostile record) sorts last, where the replay names it.
        for record in sorted(silo_records, key=lambda r: (0, r["entry"]["seq"]) if type(r["entry"].get("seq")) is int
                             else (1, 0)):
            replay.send(record)
        replay.send(None)
    except StopIteration as stop:
        composed: Composition | None = stop.value
        return composed
    raise AssertionError("a replay ends when it is sent None")


def _replay(silo_id: int, out: Outcome) -> Generator[None, dict[str, Any] | None, Composition | None]:
    """`_replay_entries`, whose any failure on a record is a finding that ends this silo's replay: a
    hostile ledger may sign any record (a filter whose weights are [1, 0, …], a mechanism that no
    longer parses, a curve of another length), and one such silo never stops the check of the others."""
    inner = _replay_entries(silo_id, out)
    next(inner)
    seq: Any = None
    while True:
        record = yield
        try:
            if record is not None:
                seq = record["entry"]["seq"]
            inner.send(record)
        except StopIteration as stop:
            composed: Composition | None = stop.value
            return composed
        # Any error, deliberately: the accounting code raises what it raises on data no honest ledger writes.
        except Exception as error:
            where = f"entry {seq}" if record is not None else f"its entries up to entry {seq}"
            out.problems.append(f"silo {silo_id} {where}: what the ledger signed does not recompose "
                                f"({type(error).__name__}: {str(error)[:200]})")
            return None


def _replay_entries(silo_id: int, out: Outcome) -> Generator[None, dict[str, Any] | None, Composition | None]:
    """Replays one silo's entries, sent one at a time (None ends it), so that an audit replays each
    page of the log while the ledger serves the next: the chain's own rules (`ChainReplay`, the replay
    the ledger's audit runs over its rows), and the ε each entry states against the RDP composition of
    the mechanisms of the charges reserved and not released, read as the gate reads it: through the
    silo's filter (its create or filter entry), or its plan's ε once it declared one. Every approval
    must also fit the budget its create entry fixed. The accounting is the service's own: the same
    functions, never a copy of them (imported here: see the module's docstring)."""
    from dpledger.service.accounting import filter as rdp_filter
    from dpledger.service.accounting import plans, rdp
    from dpledger.service.accounting.running_sum import RunningSum, curve_from_json
    from dpledger.wire.mechanisms import Mechanism

    adapter: TypeAdapter[Any] = _mechanism_adapter(Mechanism)
    budget: float | None = None
    delta: float | None = None
    fixed_by = "create"
    spec: rdp_filter.FilterSpec | None = None  # none: a silo from before filters, gated on dp-accounting's ε
    plan: plans.Plan | None = None
    plan_alive, plan_used = True, 0  # beside a plan (plans.ALONGSIDE): whether every charge followed it
    units: dict[str, list[plans.Segment] | None] = {}  # each charged mechanism's units, parsed once
    live: dict[int, np.ndarray] = {}
    total = RunningSum.empty(len(rdp.ORDERS))  # added and subtracted as the ledger does: O(orders) an entry
    readings = _Readings(out)
    chain = ChainReplay()
    curves: dict[str, np.ndarray] = {}  # a job repeats one mechanism: parse and check it once
    while (record := (yield)) is not None:
        entry, subject = record["entry"], record["subject"]
        name = f"silo {silo_id} entry {entry['seq']}"
        before = chain.seq
        # A charge id that is not a number (a hostile record) moves no charge: its entry is still read.
        charge = entry.get("charge_id") if type(entry.get("charge_id")) is int else None
        step = chain.step(Link(entry["seq"], entry["prev_hash"], entry["hash"], entry["event"], charge))
        if not step.follows:
            out.problems.append(f"{name} does not follow entry {before} of its chain")
        event = entry["event"]
        if event in ("create", "seal"):
            if event == "seal" and budget is not None and (subject.get("epsilon"), subject.get("delta")) != (budget, delta):
                went = [f"its budget went from ε={budget:g} to ε={subject.get('epsilon')}" if subject.get("epsilon") != budget
                        else "", f"its δ went from {delta:g} to {subject.get('delta')}" if subject.get("delta") != delta else ""]
                out.problems.append(f"{name}: an admin's seal changed the silo's promise to its people: "
                                    f"{' and '.join(w for w in went if w)} (fixed by its {fixed_by} entry before)")
            budget, delta, fixed_by = subject.get("epsilon"), subject["delta"], event
            if "filter" in subject:
                spec = rdp_filter.FilterSpec.from_json(subject["filter"])
            if event == "seal" and subject.get("plan") is not None:
                plan = plans.Plan.from_json(subject["plan"])
            if event == "create":
                if entry["epsilon_spent"] != 0:  # nothing is charged yet: a create entry states ε = 0
                    out.problems.append(f"{name} (create) states ε={entry['epsilon_spent']!r} before any charge")
                continue
        if event == "filter":
            spec = rdp_filter.FilterSpec.from_json(subject["filter"])
        elif event == "plan":
            plan = plans.Plan.from_json(subject["plan"])
        if delta is None:
            out.problems.append(f"{name}: the silo's create entry is missing")
            return None
        charge_id = entry["charge_id"]
        if event == "retire" and step.retired_before is not None:
            out.problems.append(f"{name} retires the silo again, after its retire entry {step.retired_before}")
        if event == "reserve" and step.retired_before is not None:
            # The operator may null the record's retirement and approve again: the signed entries say otherwise.
            out.problems.append(f"{name} (reserve of charge {charge_id}) comes after the silo's retire entry "
                                f"{step.retired_before}: a retired silo approves nothing")
        if event == "reserve":
            stored_json = subject["rdp"]
            curve = curves.get(subject["mechanism"] + stored_json)
            if curve is None:
                try:
                    mechanism = adapter.validate_json(subject["mechanism"])
                except (ValidationError, ValueError) as error:
                    out.problems.append(f"{name}: charge {charge_id}'s mechanism does not parse: {error}")
                    continue
                stored = curve_from_json(stored_json)
                # Today's charges store the certified curve; charges from before it, dp-accounting's.
                matches = [c for c in (rdp.certified_curve(mechanism), rdp.rdp_curve(mechanism))
                           if c.shape == stored.shape and np.allclose(stored, c, rtol=1e-9, equal_nan=False)]
                if not matches:
                    out.problems.append(f"{name}: charge {charge_id}'s stored RDP curve is not its mechanism's")
                    curve = rdp.certified_curve(mechanism)
                else:
                    curve = curves[subject["mechanism"] + stored_json] = matches[0]
            live[charge_id] = curve
            total = total.add(curve)
            if plan is not None and plan.alongside and plan_alive:
                if subject["mechanism"] not in units:
                    try:
                        units[subject["mechanism"]] = plans.segments(adapter.validate_json(subject["mechanism"]))
                    except (ValidationError, ValueError):
                        units[subject["mechanism"]] = None
                segments = units[subject["mechanism"]]
                taken = None if segments is None else plans.follows(plan, used=plan_used, charge=segments)
                plan_alive, plan_used = taken is not None, plan_used + (taken or 0)
        elif event == "release" and charge_id in live:
            total = total.subtract(live.pop(charge_id))
        # Beside a plan, the filter holds the share of δ the plan leaves it (ledger/gate.py).
        share = None if spec is None or plan is None or not plan.alongside else plan.filter_share
        # A commit leaves the sum as it was: its ε is the entry's before it, read once (half the reads).
        fresh = event in ("reserve", "release", "filter", "plan", "seal")
        readings.add(
            None if not fresh and readings.any else total.curve(), spec=spec, share=share, delta=delta,
            plan=plan, plan_alive=plan_alive,
            stated=math.inf if entry["epsilon_spent"] is None else entry["epsilon_spent"], name=name, event=event,
            charge_id=charge_id,
            # a plan of the rule before was priced once, when declared
            budget=budget if event == "reserve" and (plan is None or plan.alongside) else None, fixed_by=fixed_by,
        )
    composed = readings.finish()
    if delta is None or budget is None:
        out.problems.append(f"silo {silo_id}: its create entry is missing")
        return None
    if spec is not None and plan is not None and plan.alongside:
        spec = rdp_filter.scaled(spec, plan.filter_share)  # as the ledger serves it beside its plan
    return Composition(budget, delta, spec, fixed_by, composed, chain.retired_seq)


class _Readings:
    """The gate's reading after each of a silo's entries, checked against the ε the entry states, a
    block of entries at a time: one numpy pass reads a block's running sums (rdp_filter.read_many,
    rdp.epsilons) where one read at a time cost ~30 µs an entry, most of an audit's own CPU. A block
    ends where the filter, its share of δ or δ changes, and at `BLOCK` entries (memory stays bounded)."""

    BLOCK = 4096

    def __init__(self, out: Outcome) -> None:
        self.out = out
        self.curves: list[np.ndarray] = []
        self.rows: list[tuple[int, Any, bool, float, str, str, Any, float | None, str]] = []
        self.key: tuple[Any, float | None, float] | None = None
        self.last = 0.0  # the reading of the last entry checked
        self.any = False  # whether any entry was read yet
        self.previous = np.zeros(0)  # the last curve of the last block

    def add(self, curve: np.ndarray | None, *, spec: Any, share: float | None, delta: float, plan: Any, plan_alive: bool,
            stated: float, name: str, event: str, charge_id: Any, budget: float | None, fixed_by: str) -> None:
        """`curve`: the running sum after the entry, or None where it is the previous entry's."""
        key = (spec, share, delta)
        if self.key is not None and key != self.key:
            self.flush()
        self.key = key
        if curve is not None or not self.curves:
            self.curves.append(curve if curve is not None else self.previous)
        self.rows.append((len(self.curves) - 1, plan, plan_alive, stated, name, event, charge_id, budget, fixed_by))
        self.any = True
        if len(self.rows) >= self.BLOCK:
            self.flush()

    def flush(self) -> None:
        from dpledger.service.accounting import filter as rdp_filter
        from dpledger.service.accounting import plans, rdp

        if not self.rows:
            return
        assert self.key is not None
        spec, share, delta = self.key
        matrix = np.stack(self.curves)
        if spec is not None:
            by_filter = rdp_filter.read_many(spec if share is None else rdp_filter.scaled(spec, share), matrix, delta=delta)
        else:
            by_filter = rdp.epsilons(matrix, delta=delta)
        ran = np.any(matrix != 0, axis=1)
        for index, plan, plan_alive, stated, name, event, charge_id, budget, fixed_by in self.rows:
            composed = plans.gate_epsilon(plan, on_plan=plan_alive, ran=bool(ran[index]), by_filter=float(by_filter[index]))
            if not same_epsilon(stated, composed):
                self.out.problems.append(f"{name} ({event} of charge {charge_id}) states ε={stated:.6g}, "
                                         f"but its charges' mechanisms compose to ε={composed:.6g}")
            if budget is not None and not rdp.within_budget(composed, budget=budget):
                self.out.problems.append(f"{name} (reserve of charge {charge_id}) was approved at ε={composed:.6g}, "
                                         f"past the budget ε={budget:.6g} that the silo's {fixed_by} entry fixed")
            self.last = composed
        self.previous = self.curves[-1]
        self.curves, self.rows = [], []

    def finish(self) -> float:
        self.flush()
        return self.last


@functools.lru_cache(maxsize=1)
def _mechanism_adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)  # building the union's validator costs more than validating many mechanisms
