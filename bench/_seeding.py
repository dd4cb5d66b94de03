"""A long history seeded in bulk, for the benches that need one (bench/approvals.py, bench/receipts.py):
what a loop of `charges.reserve` (and `charges.commit` after each, if asked) would write, a batch of
charges per transaction.

Per charge the same values are computed with the ledger's own functions (`charges.request_hash`,
`RunningSum.add`, `gate.reading`, `chain.entry_hash`, `transparency.pending_leaf`); what the loop
pays per charge and a batch pays once is not repeated: the silo's lock, its UPDATE (its chain head
and running sums, written once at the batch's end), the statements (one executemany per table), the
pair's curve (priced once per distinct mechanism). A first charge that fixes the silo's filter goes
through `charges.reserve` itself, whatever else a first charge does. `check` compares a bulk-seeded
silo with one seeded by the loop, field by field, and audits both chains and every log leaf: a change
to what an approval writes that this module does not follow fails there, not in a bench's numbers.

Benches run as scripts, so this module is imported by its plain name (tests load it by path).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Table, select
from sqlalchemy.orm import Session

from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_to_json
from dpledger.service.ledger import audit, chain, charges, gate, silos, transparency
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.store import curves, reserving
from dpledger.service.store.db import Database, make_engine, migrate
from dpledger.service.store.models import (
    Charge,
    ChargeRecord,
    ChargeStatus,
    EntryEvent,
    EntryRecord,
    LedgerEntry,
    LogLeaf,
    Silo,
)
from dpledger.wire import merkle
from dpledger.wire.mechanisms import AnyMechanism, DpSgd

_CHARGES = cast(Table, Charge.__table__)
_ENTRIES = cast(Table, LedgerEntry.__table__)
_SILOS = cast(Table, Silo.__table__)
_ENTRY_COLUMNS = ("id", *reserving.ENTRY_COLUMNS)  # under the ids next_ids gave
BATCH = 2000  # charges per transaction


@dataclass(frozen=True)
class _Pair:
    """A distinct mechanism, priced once: its curve and the two texts every charge of it stores."""

    curve: np.ndarray
    mechanism_json: str
    curve_json: str
    curve_hash: str  # its row's key in the curves table (store/curves.py)


def seed(db: Database, silo_id: int, count: int, *, mechanism: Callable[[int], AnyMechanism], start: int = 0,
         commit: bool = False, job_id: str = "seed", key: Callable[[int], str] = lambda i: f"seed-{i}",
         batch: int = BATCH) -> None:
    """Appends charges `start` … `start + count - 1` to the silo: exactly what, for each i,
    `charges.reserve(db, silo_id=silo_id, mechanism=mechanism(i), idempotency_key=key(i),
    job_id=job_id, round=i)` (then `charges.commit(db, charge_id=…)` if `commit`) would append."""
    end = start + count
    with db.read() as session:
        silo = silos.get(session, silo_id)
        pending, planned = gate.pending(silo), silo.plan is not None
    if planned:
        raise ValueError("bulk seeding follows no plan: seed a silo without one")
    if pending and start < end:  # its first charge fixes its filter: through the ledger's own path
        view = charges.reserve(db, silo_id=silo_id, mechanism=mechanism(start), idempotency_key=key(start),
                               job_id=job_id, round=start)
        if commit:
            charges.commit(db, charge_id=view.charge_id)
        start += 1
    pairs: dict[str, _Pair] = {}
    while start < end:
        k = min(batch, end - start)
        with db.write() as session:
            silo = silos.lock(session, silo_id)
            _append_batch(session, silo, range(start, start + k), mechanism=mechanism, commit=commit, job_id=job_id,
                          key=key, pairs=pairs)
        start += k


def _append_batch(session: Session, silo: Silo, rounds: range, *, mechanism: Callable[[int], AnyMechanism],
                  commit: bool, job_id: str, key: Callable[[int], str], pairs: dict[str, _Pair]) -> None:
    spent = RunningSum.from_json(silo.rdp_spent)
    committed = RunningSum.from_json(silo.rdp_committed)
    seq, head = silo.chain_seq, silo.chain_head
    store = reserving.of(session)
    charge_ids = store.next_ids(session, _CHARGES, len(rounds))
    entry_ids = iter(store.next_ids(session, _ENTRIES, len(rounds) * (2 if commit else 1)))
    charge_rows: list[dict[str, Any]] = []
    entry_rows: list[dict[str, Any]] = []
    leaf_rows: list[dict[str, Any]] = []
    used: dict[str, str] = {}  # the curves the batch's charges name, by key

    def entry(event: EntryEvent, charge: ChargeRecord, subject_text: str, eps: float) -> None:
        nonlocal seq, head
        record = EntryRecord(silo_id=silo.id, seq=seq + 1, event=event, charge_id=charge.id, epsilon_spent=eps,
                             created_at=datetime.now(UTC), prev_hash=head, hash="", id=next(entry_ids))
        record.hash = chain.entry_hash(record, subject_text=subject_text)
        leaf, _ = transparency.pending_leaf(record, subject_text=subject_text)
        entry_rows.append({column: getattr(record, column) for column in _ENTRY_COLUMNS})
        leaf_rows.append({"entry_id": record.id, **leaf})
        seq, head = record.seq, record.hash

    for charge_id, i in zip(charge_ids, rounds, strict=True):
        requested = mechanism(i)
        pair_key = requested.model_dump_json()
        pair = pairs.get(pair_key)
        if pair is None:
            priced = charges.price(requested, silo=silo, charged=True)
            text = curve_to_json(priced.curve)
            pair = pairs[pair_key] = _Pair(priced.curve, priced.mechanism.model_dump_json(), text, curves.key(text))
        used[pair.curve_hash] = pair.curve_json
        candidate = spent.add(pair.curve)
        eps = gate.reading(silo, candidate).epsilon  # the silo's fixed filter, as reserve's check reads it
        if not rdp.within_budget(eps, budget=silo.epsilon):
            raise RuntimeError(f"seeding went over budget at charge {i}: ε={eps}")
        charge = ChargeRecord(
            id=charge_id, silo_id=silo.id, idempotency_key=key(i),
            request_hash=charges.request_hash(mechanism=requested, job_id=job_id, round=i),
            mechanism=pair.mechanism_json, curve_hash=pair.curve_hash, rdp=pair.curve_json, order_grid=rdp.ORDER_GRID_ID,
            conversion=rdp.LEDGER_CONVERSION_ID, status=ChargeStatus.committed if commit else ChargeStatus.reserved,
            job_id=job_id, round=i, epsilon_spent_after=eps, created_at=datetime.now(UTC), touched_at=None,
            attempt_id=None,
        )
        charge_rows.append({column.name: getattr(charge, column.name) for column in _CHARGES.c})
        subject_text = chain.canonical(chain.charge_fields(charge))  # a charge's entries all cover this text
        entry(EntryEvent.reserve, charge, subject_text, eps)
        spent = candidate
        if commit:  # the reading of the unchanged spent sum: the reserve's ε again
            committed = committed.add(pair.curve)
            entry(EntryEvent.commit, charge, subject_text, eps)
    for text in used.values():  # each once, unless this process knows it stored, as reserve() writes it
        curves.store(session, text)
    reserving.append_many(session, silo_id=silo.id, charges=charge_rows, entries=entry_rows, leaves=leaf_rows, columns={
        "chain_seq": seq, "chain_head": head, "rdp_spent": spent.to_json(), "rdp_committed": committed.to_json()})


def check_mechanism(i: int) -> DpSgd:
    """Four pairs in turn: a batch meets a pair it priced before and one it has not."""
    return DpSgd(batch_size=256, noise_multiplier=(1.0, 1.1, 1.2, 1.3)[i % 4], steps=1)


def _state(session: Session, silo_id: int) -> tuple[Any, ...]:
    """What a silo's history says, less ids, times and the hashes that cover them."""
    silo = session.get(Silo, silo_id)
    assert silo is not None
    charge_columns = [c.name for c in _CHARGES.c if c.name not in ("id", "silo_id", "created_at")]
    rows = session.scalars(select(Charge).where(Charge.silo_id == silo_id).order_by(Charge.id)).all()
    keys = {c.id: c.idempotency_key for c in rows}
    entries = session.scalars(select(LedgerEntry).where(LedgerEntry.silo_id == silo_id).order_by(LedgerEntry.seq)).all()
    silo_columns = [c.name for c in _SILOS.c if c.name not in ("id", "name", "chain_head", "created_at")]
    return (
        {column: getattr(silo, column) for column in silo_columns},
        [tuple(getattr(c, column) for column in charge_columns) for c in rows],
        [(e.seq, e.event, keys.get(e.charge_id), e.epsilon_spent) for e in entries],
    )


def check(url: str | None = None, *, count: int = 25, commit: bool = False, batch: int = 10) -> str:
    """Seeds one silo by the loop and another in bulk (`batch` charges a transaction) on `url`
    (default: a SQLite file of its own), compares them, audits both chains, sequences the log and
    checks every leaf against its record."""
    with tempfile.TemporaryDirectory(prefix="dpledger-seedcheck-") as folder:
        url = url or f"sqlite:///{folder}/check.db"
        migrate(url)
        db = Database(make_engine(url))
        try:
            return _check(db, count=count, commit=commit, batch=batch)
        finally:
            db.dispose()


def _check(db: Database, *, count: int, commit: bool, batch: int) -> str:
    terms = {"epsilon": 1e4, "delta": 1e-5, "dataset_size": 60_000}
    by_loop, _ = silos.register(db, name="by-loop", **terms)
    in_bulk, _ = silos.register(db, name="in-bulk", **terms)
    for i in range(count):
        view = charges.reserve(db, silo_id=by_loop.id, mechanism=check_mechanism(i), idempotency_key=f"seed-{i}",
                               job_id="seed", round=i)
        if commit:
            charges.commit(db, charge_id=view.charge_id)
    seed(db, in_bulk.id, count, mechanism=check_mechanism, commit=commit, batch=batch)
    signer = TreeHeadSigner(Ed25519PrivateKey.generate())
    with db.write() as session:
        while transparency.sequence(session, lambda size, root: signer.sign(tree_size=size, root_hash=root)):
            pass
    with db.read() as session:
        loop, bulk = _state(session, by_loop.id), _state(session, in_bulk.id)
        report = audit.verify(session, [by_loop.id, in_bulk.id])
        leaves = list(session.scalars(select(LogLeaf).order_by(LogLeaf.idx)))
        records = transparency.records_of(session, leaves)
        bad_leaves = [leaf.idx for leaf, (_, record) in zip(leaves, records, strict=True)
                      if record is None or merkle.leaf_hash(record.encode()).hex() != leaf.leaf_hash]
    differences = [name for name, a, b in zip(("silo", "charges", "entries"), loop, bulk, strict=True) if a != b]
    if differences or not report.ok or bad_leaves:
        raise RuntimeError(f"bulk seeding differs from a loop of reserve(){' and commit()' if commit else ''}: "
                           f"{differences or 'same rows'}; audit {report.problems[:3]}; bad leaves {bad_leaves[:5]}")
    return (f"bulk seeding == a loop of reserve(){' + commit()' if commit else ''} for {count} charges "
            f"({db.engine.dialect.name}: silo columns, charge rows, entries; chains audit, {len(leaves)} leaves match)")

