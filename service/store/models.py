"""Tables of the ledger (SQLAlchemy 2, typed). Wire models live in dpledger/wire/schemas.py."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    select,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column
from sqlalchemy.types import TypeDecorator

# Re-exported (`X as X`): the tables' vocabularies are part of what this module offers its callers.
from dpledger.wire.enums import ChargeStatus as ChargeStatus
from dpledger.wire.enums import EntryEvent as EntryEvent
from dpledger.wire.enums import Relation as Relation
from dpledger.wire.enums import Role as Role
from dpledger.wire.enums import SearchStatus as SearchStatus

E = TypeVar("E", bound=enum.Enum)


class StoredEnum(TypeDecorator[E], Generic[E]):
    """An enum column stored as its value's string, as these columns always were (no native type,
    no CHECK: the schema is unchanged). A stored string that is no member (an edited row) reads
    back as the raw string rather than failing the load, so that `verify` can report it."""

    impl = String(16)
    cache_ok = True

    def __init__(self, kind: type[E]) -> None:
        super().__init__()
        self.kind = kind

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else str(self.kind(value).value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        try:
            return self.kind(value)
        except ValueError:
            return value


class Base(DeclarativeBase):
    pass


class Silo(Base):
    __tablename__ = "silos"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    epsilon: Mapped[float] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    dataset_size: Mapped[int] = mapped_column(BigInteger)
    relation: Mapped[Relation] = mapped_column(
        StoredEnum(Relation), default=Relation.add_remove, server_default=Relation.add_remove.value
    )
    # Running sums (RunningSum JSON) of reserved + committed, and of committed only: an approval
    # reads these instead of replaying history.
    rdp_spent: Mapped[str] = mapped_column(Text)
    rdp_committed: Mapped[str] = mapped_column(Text)
    chain_seq: Mapped[int] = mapped_column(Integer, default=0)
    chain_head: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The gate's Rényi filter (accounting/filter.py FilterSpec JSON), fixed before the first charge,
    # and the seq of the entry whose hash covers it: 1 (the create entry) for silos registered with
    # it, a `filter` entry for silos that held charges before the filter existed.
    filter_spec: Mapped[str] = mapped_column(Text)
    filter_seq: Mapped[int] = mapped_column(Integer)
    # The filter a silo registered with (its horizon's), kept once its first charge refit it (gate.py),
    # so that its create entry, which covers it, still recomputes. None: never refit.
    registered_filter: Mapped[str | None] = mapped_column(Text)
    # A declared plan (ledger/plans.py JSON) and how many of its units charges have used.
    plan: Mapped[str | None] = mapped_column(Text)
    plan_used: Mapped[int] = mapped_column(Integer, default=0)
    # The seq of the reserve entry whose charge left the plan, ending its branch (accounting/plans.py
    # ALONGSIDE): from then on the gate reads the filter alone. None: the branch is alive, or no plan.
    plan_ended_seq: Mapped[int | None] = mapped_column(Integer)
    # The seq of the newest `seal` entry (an admin accepted the record after a tamper; ledger/seals.py),
    # which then covers the record in place of the create, filter and plan entries. None: never sealed.
    sealed_seq: Mapped[int | None] = mapped_column(Integer)
    # The seq of the silo's `retire` entry and the reason it covers (ledger/silos.py retire): from then on
    # the silo approves nothing, and its name stays its own. None: in service.
    retired_seq: Mapped[int | None] = mapped_column(Integer)
    retired_reason: Mapped[str | None] = mapped_column(Text)


class Curve(Base):
    """An RDP curve at the order grid, stored once per ledger (store/curves.py): its exact text, keyed by
    the text's SHA-256. Rows are only ever added; the charges that name a curve share it."""

    __tablename__ = "curves"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    rdp: Mapped[str] = mapped_column(Text)


class Charge(Base):
    __tablename__ = "charges"
    __table_args__ = (UniqueConstraint("silo_id", "idempotency_key", name="uq_charges_silo_idempotency"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    silo_id: Mapped[int] = mapped_column(ForeignKey("silos.id"), index=True)
    idempotency_key: Mapped[str] = mapped_column(String(200))
    request_hash: Mapped[str] = mapped_column(String(64))
    mechanism: Mapped[str] = mapped_column(Text)  # resolved mechanism JSON (q filled in by the service)
    # Its RDP curve at the order grid below: the key of its row in `curves`, and the text read through it
    # with every load of a charge (what its entries' hashes cover; None only where the row is gone).
    curve_hash: Mapped[str] = mapped_column(ForeignKey("curves.hash", name="fk_charges_curve_hash_curves"))
    rdp: Mapped[str] = column_property(
        select(Curve.rdp).where(Curve.hash == curve_hash).correlate_except(Curve).scalar_subquery()
    )
    order_grid: Mapped[str] = mapped_column(String(100))
    conversion: Mapped[str] = mapped_column(String(100))
    status: Mapped[ChargeStatus] = mapped_column(StoredEnum(ChargeStatus))
    job_id: Mapped[str | None] = mapped_column(String(200))
    round: Mapped[int | None] = mapped_column(Integer)
    epsilon_spent_after: Mapped[float] = mapped_column(Float)  # the silo's ε right after approval
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # When an output of the charge's round (a norm, a trial's score) first reached the ledger: the
    # round touched the data, so the charge may only be committed, never released.
    touched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The random id of the attempt whose reserve made the charge: answered on every replay, so only
    # that attempt (retrying its own lost request) trains on it. None: no attempt may claim it.
    attempt_id: Mapped[str | None] = mapped_column(String(64))


class LedgerEntry(Base):
    """Append-only and hash-chained, one chain per silo so that silos never wait on each other."""

    __tablename__ = "ledger_entries"
    __table_args__ = (
        UniqueConstraint("silo_id", "seq", name="uq_ledger_entries_silo_seq"),
        Index("ix_ledger_entries_charge", "charge_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    silo_id: Mapped[int] = mapped_column(ForeignKey("silos.id"))
    seq: Mapped[int] = mapped_column(Integer)
    event: Mapped[EntryEvent] = mapped_column(StoredEnum(EntryEvent))
    charge_id: Mapped[int | None] = mapped_column(ForeignKey("charges.id"))
    epsilon_spent: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


# A silo's row as an approval's lock reads it (store/reserving.py), plain: the ORM's load of a locked
# row cost an approval ~95 µs of CPU where the statement's own row costs ~20. Its columns are Silo's
# (tests/service/test_store_conformance.py holds them equal). What the approval changes on it (a first
# charge's filter, a plan's units) is written with its entry's columns (`changed`), in the store's one
# UPDATE of the silo, where the ORM's flush wrote a Silo's.
@dataclass(slots=True, eq=False)
class SiloRecord:
    id: int
    name: str
    epsilon: float
    delta: float
    dataset_size: int
    relation: Relation
    rdp_spent: str
    rdp_committed: str
    chain_seq: int
    chain_head: str
    created_at: datetime
    filter_spec: str
    filter_seq: int
    registered_filter: str | None
    plan: str | None
    plan_used: int
    plan_ended_seq: int | None
    sealed_seq: int | None
    retired_seq: int | None
    retired_reason: str | None
    _as_stored: tuple[Any, ...] = ()  # the columns' values as stored (read, or written since)

    def __post_init__(self) -> None:
        self._as_stored = self._values()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in SILO_COLUMNS)

    def changed(self) -> dict[str, Any]:
        """The columns set since they were read or stored (by identity: a value set again is written again)."""
        return {name: value for name, value, stored in zip(SILO_COLUMNS, self._values(), self._as_stored, strict=True)
                if value is not stored}

    def stored(self, columns: dict[str, Any]) -> None:
        """Sets `columns` as written to the row."""
        for name, value in columns.items():
            setattr(self, name, value)
        self._as_stored = tuple(columns[name] if name in columns else value
                             for name, value in zip(SILO_COLUMNS, self._as_stored, strict=True))


# SiloRecord's columns, in the order its constructor takes them.
SILO_COLUMNS = tuple(name for name in SiloRecord.__dataclass_fields__ if not name.startswith("_"))


# An approval's new charge and entry as plain records of the values it inserted (INSERT … RETURNING
# id): it hashes and answers them and never flushes them, and an ORM instance costs ~10–20 µs to build.
@dataclass(slots=True)
class ChargeRecord:
    id: int
    silo_id: int
    idempotency_key: str
    request_hash: str
    mechanism: str
    curve_hash: str
    rdp: str  # the curve's text, which its entries' hashes cover
    order_grid: str
    conversion: str
    status: ChargeStatus
    job_id: str | None
    round: int | None
    epsilon_spent_after: float
    created_at: datetime
    touched_at: datetime | None
    attempt_id: str | None


@dataclass(slots=True)
class EntryRecord:
    silo_id: int
    seq: int
    event: EntryEvent
    charge_id: int | None
    epsilon_spent: float
    created_at: datetime
    prev_hash: str
    hash: str
    id: int = 0  # set once inserted


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[Role] = mapped_column(StoredEnum(Role))
    silo_id: Mapped[int | None] = mapped_column(ForeignKey("silos.id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class PrivacyLevel(Base):
    """A menu entry (FedHDP §2): silos may register by choosing one; it is a budget like any other."""

    __tablename__ = "privacy_levels"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    epsilon: Mapped[float] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class JobSilo(Base):
    __tablename__ = "job_silos"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    silo_id: Mapped[int] = mapped_column(ForeignKey("silos.id"), primary_key=True)


class NormReport(Base):
    """The L2 norm of a silo's noisy update in one round: already private, so free to share."""

    __tablename__ = "norm_reports"
    __table_args__ = (UniqueConstraint("job_id", "round", "silo_id", name="uq_norm_reports_job_round_silo"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    round: Mapped[int] = mapped_column(Integer)
    silo_id: Mapped[int] = mapped_column(ForeignKey("silos.id"))
    l2_norm: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Search(Base):
    """A private hyperparameter search (Liu et al. 2022 §7; Papernot & Steinke 2022): one
    repeat_and_select charge, reserved up front, and the K the service drew for it."""

    __tablename__ = "searches"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    silo_id: Mapped[int] = mapped_column(ForeignKey("silos.id"), index=True)
    charge_id: Mapped[int] = mapped_column(ForeignKey("charges.id"), unique=True)
    trial_mechanism: Mapped[str] = mapped_column(Text)  # one trial's mechanism JSON, as requested
    distribution: Mapped[str] = mapped_column(String(40))
    shape: Mapped[str] = mapped_column(String(40))  # a float's repr, or "infinity"
    mean_trials: Mapped[float] = mapped_column(Float)
    trials: Mapped[int] = mapped_column(Integer)  # K, drawn by the service
    trials_reported: Mapped[int] = mapped_column(Integer, default=0)
    best_score: Mapped[float | None] = mapped_column(Float)
    status: Mapped[SearchStatus] = mapped_column(StoredEnum(SearchStatus))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LogLeaf(Base):
    """The transparency log's leaves (RFC 9162), one per ledger entry of any silo, in append order.
    The salt keeps a leaf hash from being inverted by guessing: a silo sees other silos' leaf hashes.
    `entry_id` is no foreign key on purpose: a leaf is evidence and outlives a deleted entry, which
    then shows as a leaf with nothing behind it."""

    __tablename__ = "log_leaves"

    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    entry_id: Mapped[int] = mapped_column(Integer, unique=True)
    salt: Mapped[str] = mapped_column(String(32))
    leaf_hash: Mapped[str] = mapped_column(String(64))
    # The deadline (ms since the epoch) its receipt promised it by, kept from its pending row so
    # that a replayed answer carries the very promise of the first; null for leaves from before 0011.
    promised_by: Mapped[int | None] = mapped_column(BigInteger)


class LogPending(Base):
    """Leaves written by approvals and not yet given a log index: an approval inserts its row in its
    own transaction (no row shared by silos); the sequencer (ledger/sequencer.py) moves rows to
    `log_leaves`, in `id` order, in batches. A silo's entries commit one after the other under its
    lock, so `id` order keeps each silo's chain order in the log."""

    __tablename__ = "log_pending"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    entry_id: Mapped[int] = mapped_column(Integer, unique=True)
    salt: Mapped[str] = mapped_column(String(32))
    leaf_hash: Mapped[str] = mapped_column(String(64))
    promised_by: Mapped[int] = mapped_column(BigInteger)  # ms since the epoch: the receipt's deadline


class LogHead(Base):
    """The head the sequencer signed after each batch: a receipt read after its entry was sequenced
    carries the head of that entry's batch and the path to it."""

    __tablename__ = "log_heads"

    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    root_hash: Mapped[str] = mapped_column(String(64))
    timestamp: Mapped[int] = mapped_column(BigInteger)  # ms since the epoch
    key_id: Mapped[str] = mapped_column(String(64))
    signature: Mapped[str] = mapped_column(String(200))


class LogNode(Base):
    """Every perfect, aligned subtree of width 2**level ≥ 2 that the log has completed: a root or a
    proof then reads O(log n) rows, never the leaves."""

    __tablename__ = "log_nodes"

    level: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)  # start // 2**level
    hash: Mapped[str] = mapped_column(String(64))


class LogState(Base):
    """One row: the log's size and frontier (the roots of the perfect subtrees it decomposes into,
    left to right, hex JSON). Written by the sequencer alone, once a batch; no approval reads it."""

    __tablename__ = "log_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    size: Mapped[int] = mapped_column(BigInteger)
    frontier: Mapped[str] = mapped_column(Text)


class VerifiedHead(Base):
    """A signed head that an auditor's `dpledger audit` verified, for the dashboard. Evidence lives
    with the auditor (its head file); this row only says when someone last looked."""

    __tablename__ = "verified_heads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tree_size: Mapped[int] = mapped_column(BigInteger)
    root_hash: Mapped[str] = mapped_column(String(64))
    signed_at: Mapped[int] = mapped_column(BigInteger)  # the head's own timestamp, ms since the epoch
    key_id: Mapped[str] = mapped_column(String(64))
    signature: Mapped[str] = mapped_column(String(200))
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"))
    verified_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
