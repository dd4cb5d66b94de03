"""Wire models (pydantic v2) of the HTTP API; separate from the service's tables (`dpledger.service.store.models`)."""

from __future__ import annotations

import math
import unicodedata
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from dpledger.wire.enums import ChargeStatus, EntryEvent, Relation, Role
from dpledger.wire.mechanisms import MAX_COUNT, Mechanism, check_nesting
from dpledger.wire.receipts import RECEIPT_NOTE, Receipt

# Strict numbers: a JSON `true` is refused, never read as 1 (`dataset_size: true` was stored as 1).
Epsilon = Annotated[float, Field(gt=0, le=1e4, allow_inf_nan=False, strict=True, description="privacy budget ε > 0")]
Delta = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False, strict=True, description="δ in (0, 1)")]
DatasetSize = Annotated[int, Field(ge=1, le=10**12, strict=True)]


def delta_refusal(delta: float, dataset_size: int) -> str | None:
    """Why a silo's δ promises nothing for `dataset_size` records, or None when it can be a guarantee.

    δ ≥ 1/n admits a mechanism that publishes one record, picked at random, in full: it is (0, δ)-DP
    with δ = 1/n. No override: a silo registered so could only be retired, its people never protected.
    """
    if delta * dataset_size < 1:
        return None
    return (f"delta={delta:g} is not below 1/dataset_size = 1/{dataset_size} = {1 / dataset_size:.3g}: at that δ, "
            "publishing one record in full meets the promise, so it guarantees nothing; choose δ well below 1/n "
            f"(e.g. {_suggested_delta(dataset_size):g})")


def _suggested_delta(dataset_size: int) -> float:
    # The common rule of thumb δ ≪ 1/n: a power of ten at or below 1/(100·n), never above 1e-5.
    return min(1e-5, 10.0 ** math.floor(math.log10(1 / (100 * dataset_size))))


def _no_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL, so the insert would fail as a 500 there (and pass on SQLite).
    if "\x00" in value:
        raise ValueError("must not contain NUL (0x00) characters")
    return value


# Names, keys and job ids: stored as text on every database.
Text = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_no_nul)]
# Ids are PostgreSQL `integer` columns: a larger one names nothing, and the database driver would
# refuse it with an overflow (a 500) where the caller deserves a 422 naming the field.
MAX_ID = 2**31 - 1
Id = Annotated[int, Field(ge=1, le=MAX_ID, strict=True)]
# A job's round as an index from 0 (people read round r + 1: the CLI and the dashboard show it so).
Round = Annotated[int, Field(ge=0, le=10**9, strict=True)]
# A reserve request's attempt id: 16–64 characters of [A-Za-z0-9_-], random per attempt (128 bits or more).
AttemptId = Annotated[str, Field(min_length=16, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


def finite_or_none(value: float | None) -> float | None:
    """JSON has no infinity: an infinite ε goes out as null (the detail says why)."""
    return value if value is not None and math.isfinite(value) else None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _WithMechanism(_Request):
    mechanism: Mechanism

    @field_validator("mechanism", mode="before")
    @classmethod
    def _bounded_nesting(cls, value: Any) -> Any:
        return check_nesting(value)


class SiloCreateRequest(_Request):
    """A budget given as (epsilon, delta), or chosen from the menu by `level` (FedHDP §2)."""

    name: Text
    epsilon: Epsilon | None = None
    delta: Delta | None = None
    level: Text | None = None
    dataset_size: DatasetSize
    relation: Relation = Field(
        Relation.add_remove,
        description="the silo's neighbouring relation: add_remove (default), or replace_one when its size is public; "
        "mechanisms analysed under the other relation are refused on this silo",
    )
    horizon: Mechanism | None = Field(
        None,
        description="the workload the silo expects to spend its budget on; its filter's committed order is "
        "where that workload, scaled to the budget, has its lowest ε (default: DP-SGD at batch 256 or 1% of the set, "
        "whichever is smaller, noise 1)",
    )

    @field_validator("horizon", mode="before")
    @classmethod
    def _bounded_nesting(cls, value: Any) -> Any:
        return value if value is None else check_nesting(value)

    @model_validator(mode="after")
    def _budget_or_level(self) -> SiloCreateRequest:
        if self.level is not None:
            if self.epsilon is not None or self.delta is not None:
                raise ValueError("give either level or (epsilon, delta), not both")
        elif self.epsilon is None or self.delta is None:
            raise ValueError("epsilon and delta are required unless a level is chosen")
        return self


# A silo's registered promise, as every answer about a silo starts (fields first, in this order).
class _SiloFields(BaseModel):
    id: int
    name: str
    epsilon: float
    delta: float
    dataset_size: int
    relation: Relation


class SiloCreated(_SiloFields):
    api_key: str = Field(description="the silo's key, shown once")


# Beside every ε the ledger states (the gate's reading), labelled as a reference (docs/concepts/gate.md).
_REFERENCE_NOTE = ("for reference only: dp-accounting's non-adaptive RDP ε of the same charges (best order, whole δ), "
                   "which adaptive choices may exceed")


def _reference(of: str = "") -> Any:
    return Field(None, description=_REFERENCE_NOTE + (f", beside {of}" if of else ""))


class SiloSummary(_SiloFields):
    epsilon_spent: float | None
    epsilon_dp_accounting: float | None = _reference("epsilon_spent")
    retired_seq: int | None = Field(None, description="the silo's retire entry, where an admin retired it: it approves "
                                    "nothing since (its earlier reservations are still settled); null: in service")
    retired_reason: str | None = Field(None, description="why an admin retired the silo, as its retire entry covers it")


class FilterView(BaseModel):
    orders: list[float] = Field(description="the Rényi orders of the silo's filter, fixed before its first charge")
    weights: list[float] = Field(description="each order's share of δ (union bound)")
    source: str = Field(description="horizon (from the budget and a horizon at registration), first_charge (a silo "
                        "registered without a horizon: from its budget and its first charge), refit (a registered "
                        "horizon that was not the workload, refit by the first charge), or legacy")
    parts: list[str] = Field(default_factory=list, description="a horizon's filter: the digests (16 hex digits of "
                             "the SHA-256 of the resolved mechanism's JSON) of the horizon and of every mechanism "
                             "inside it. A first charge it does not name is refit to what the silo runs")


class PlanView(BaseModel):
    mechanism: dict[str, Any]
    epsilon: float = Field(description="the plan's ε at its share of the silo's δ (dp-accounting's PLD accountant)")
    units: int
    units_used: int
    after: str = Field(description="filter: the silo's filter approves beside the plan and after it, on the rest of "
                       "δ; closed (plans declared before that rule): the plan is the silo's whole budget")
    delta_share: float = Field(1.0, description="the plan's share of the silo's δ (the filter holds the rest)")
    ended_at_seq: int | None = Field(None, description="the reserve entry of the first charge off the plan, which "
                                     "ended the plan's branch: since then the filter alone gates the silo")


class SiloDetail(SiloSummary):
    epsilon_committed: float | None
    epsilon_remaining: float
    rho: float | None
    order: float
    filter: FilterView | None = Field(None, description="the gate's filter; none until the first charge of a silo "
                                      "registered without a horizon, which fixes it from that charge")
    plan: PlanView | None = None
    gated_on: Literal["rdp_filter", "plan", "plan_and_filter"] = Field(
        "rdp_filter", description="rdp_filter; plan_and_filter: the lower of the plan's ε and the filter's while "
        "every charge follows the plan; plan: a plan of the rule before, alone")


def _one_line_reason(value: str) -> str:
    # Quoted in every refusal of the silo, which is one line: no line breaks or other control characters.
    if not value.strip():
        raise ValueError("must say why the silo is retired, not only spaces")
    found = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if found is not None:
        raise ValueError(f"must be one line of text: no control characters (found {found!r})")
    return value


class SiloRetireRequest(_Request):
    """Why the silo is retired: kept in its retire entry and quoted in every refusal from then on."""

    reason: Annotated[str, Field(min_length=1, max_length=500, description="1 to 500 characters on one line"),
                      AfterValidator(_one_line_reason)]


class PlanRequest(_WithMechanism):
    """One fixed plan, declared before the silo's first charge: the mechanisms it will run, in order."""


class ChargeRequest(_WithMechanism):
    idempotency_key: Text
    job_id: Text | None = None
    round: Round | None = None
    attempt_id: AttemptId | None = Field(
        None, description="a random id of this attempt (the same on its own retries): the ledger keeps the first "
        "attempt's id with the charge and answers it on every replay, so a worker trains only on its own reservation",
    )


class ChargeReserved(BaseModel):
    """A charge as it stands: the answer to a reservation (201 fresh; 200 with `replayed` when the
    idempotency key was seen before, whatever became of that charge since), and to
    `GET /v1/charges/{id}`. Only a fresh reservation may let a worker touch the data."""

    charge_id: int
    status: ChargeStatus = Field(description="reserved, committed or released: the charge's real state now")
    replayed: bool = Field(description="true when this answers an idempotency key seen before: no new approval")
    epsilon: float | None = Field(description="this charge's own ε at the silo's δ, alone (dp-accounting's RDP "
                                  "conversion of its curve; null: infinite)")
    epsilon_spent: float | None = Field(description="the silo's ε spent (reserved + committed) now")
    epsilon_dp_accounting: float | None = _reference("epsilon_spent")
    epsilon_remaining: float
    job_id: str | None
    round: int | None
    attempt_id: str | None = Field(
        None, description="the id of the attempt that made the reservation (null: none was sent); a worker whose own "
        "id this is not must not train on the charge",
    )
    receipt: Receipt | None = Field(None, description=RECEIPT_NOTE)


class OverBudgetResponse(BaseModel):
    detail: str
    epsilon: float = Field(description="the silo's budget")
    epsilon_spent: float | None
    epsilon_if_approved: float | None = Field(description="the gate's reading (proven under adaptive choices) of the "
                                              "silo's charges with this one: what the ledger would charge")
    epsilon_dp_accounting: float | None = Field(
        None, description="for reference only: dp-accounting's non-adaptive RDP ε of the same charges (best order, "
        "whole δ), which adaptive choices may exceed")


class ChargeSettled(BaseModel):
    charge_id: int
    status: ChargeStatus
    epsilon_spent: float | None
    epsilon_dp_accounting: float | None = _reference("epsilon_spent")
    receipt: Receipt | None = Field(None, description=RECEIPT_NOTE)


class HistoryEntry(BaseModel):
    seq: int
    charge_id: int | None
    event: EntryEvent
    mechanism: dict[str, Any] | None
    subject: dict[str, Any] | None = Field(None, description="the filter (create, filter) or plan (plan) the entry's hash covers")
    job_id: str | None
    round: int | None
    epsilon_spent: float | None = Field(description="the silo's ε after this entry, as the ledger stated it: the "
                                        "gate's reading (proven under adaptive choices), what the ledger charges")
    epsilon_dp_accounting: float | None = Field(
        None, description="for reference only: dp-accounting's non-adaptive RDP ε of the same charges (best order, "
        "whole δ), which adaptive choices may exceed")
    created_at: datetime
    prev_hash: str
    hash: str


class VerifyResponse(BaseModel):
    ok: bool
    entries: int
    first_bad_seq: int | None
    first_bad_silo_id: int | None
    bad_charge_ids: list[int]
    problems: list[str]


class QuoteRequest(_WithMechanism):
    """Charges nobody, so raw sampling rates are taken; with `silo_id` (a silo its caller may read),
    batch sizes resolve against the silo and the silo's relation applies."""

    delta: Delta | None = Field(None, description="required unless silo_id is given (then the silo's δ)")
    silo_id: Id | None = None


# Bounds of one rounds quote: a plan searches at most MAX_PLAN_ROUNDS rounds, said as runs of equal
# rounds, and each distinct mechanism is priced once (a new (q, σ) pair costs dp-accounting ~50 ms).
MAX_PLAN_ROUNDS = 10_000
MAX_PLAN_RUNS = 1_000
MAX_PLAN_MECHANISMS = 32


class RoundRun(_Request):
    """`count` consecutive rounds that each charge `mechanism` (null: rounds that read no data)."""

    mechanism: Mechanism | None
    count: Annotated[int, Field(ge=1, le=MAX_PLAN_ROUNDS, strict=True)]

    @field_validator("mechanism", mode="before")
    @classmethod
    def _bounded_nesting(cls, value: Any) -> Any:
        return None if value is None else check_nesting(value)


class RoundsQuoteRequest(_Request):
    """A job's rounds for one silo, in order: how many its remaining budget buys, as its gate would
    approve them one by one, and with `calibrate` the σ at which it buys the first `rounds`."""

    silo_id: Id
    rounds: Annotated[int, Field(ge=1, le=MAX_PLAN_ROUNDS, strict=True, description="the job's rounds")]
    runs: Annotated[list[RoundRun], Field(min_length=1, max_length=MAX_PLAN_RUNS)]
    calibrate: bool = Field(False, description="also the σ for `rounds` rounds (every one the same plain DP-SGD)")

    @model_validator(mode="after")
    def _bounded(self) -> RoundsQuoteRequest:
        total = sum(run.count for run in self.runs)
        if total > MAX_PLAN_ROUNDS:
            raise ValueError(f"runs: their counts must sum to at most {MAX_PLAN_ROUNDS}. Found {total}.")
        if total < self.rounds:
            raise ValueError(f"runs: their counts must cover the job's rounds={self.rounds}. Found {total}.")
        distinct = {run.mechanism.model_dump_json() for run in self.runs if run.mechanism is not None}
        if len(distinct) > MAX_PLAN_MECHANISMS:
            raise ValueError(f"runs: at most {MAX_PLAN_MECHANISMS} distinct mechanisms. Found {len(distinct)}.")
        return self


class RoundsQuote(BaseModel):
    """Every `epsilon_*` is the silo's gate's own reading at its δ, what the ledger states and charges; each
    `*_dp_accounting` beside it is dp-accounting's non-adaptive RDP ε of the same charges (best order, whole δ),
    for reference only: adaptive choices may exceed it (null: unbounded)."""

    silo_id: int
    epsilon: float = Field(description="the silo's budget")
    delta: float
    epsilon_spent: float | None
    epsilon_spent_dp_accounting: float | None
    epsilon_after_first_round: float | None = Field(
        description="the silo's ε once the job's first charged round is approved on top of what it has spent")
    epsilon_after_first_round_dp_accounting: float | None
    affordable_rounds: int = Field(description="the most leading rounds whose charges, added one by one to what the "
                                   "silo has spent, its gate approves (at most the rounds sent)")
    horizon: int = Field(description="the rounds sent")
    epsilon_after_rounds: float | None = Field(description="the silo's ε were the job's `rounds` rounds all approved")
    epsilon_after_rounds_dp_accounting: float | None
    noise_multiplier: float | None = Field(None, description="with calibrate: the σ for all `rounds` rounds")
    noise_note: str | None = Field(None, description="with calibrate: why no σ")


class QuoteResponse(BaseModel):
    epsilon: float | None
    order: float
    rho: float | None
    epsilon_pld: float | None
    pld_note: str | None = Field(None, description="why no PLD ε, where dp-accounting's PLD accountant lacks the mechanism")
    delta: float
    silo_epsilon_spent: float | None = None
    silo_epsilon_spent_dp_accounting: float | None = _reference("silo_epsilon_spent")
    epsilon_if_approved: float | None = None
    epsilon_if_approved_dp_accounting: float | None = _reference("epsilon_if_approved")
    epsilon_rdp_proven: float | None = Field(
        None, description="ε by the union-bound Rényi filter: the silo's (spent + this), or without a silo, a filter "
        "committed to this mechanism's best order")
    epsilon_plan: float | None = Field(
        None, description="the PLD ε if this mechanism were declared as the silo's plan, on the plan's share of the "
        "silo's δ as the plan would be stored (without a silo: at `delta`); null where it cannot be one")
    plan_note: str | None = None
    gated_on: Literal["rdp_filter", "plan", "plan_and_filter"] | None = Field(
        None, description="what the silo's approvals are checked against (null without a silo)")


class CalibrateRequest(_Request):
    # A floor on the target: dp-accounting's bracket search for ε near 0 (5e-324 was fuzzed) spins
    # for seconds of CPU before it gives up, and any key may call this route.
    epsilon: Annotated[Epsilon, Field(ge=1e-4, description="target ε in [1e-4, 1e4]")]
    delta: Delta
    sampling_rate: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
    steps: Annotated[int, Field(ge=1, le=10_000_000, strict=True)]


class CalibrateResponse(BaseModel):
    noise_multiplier: float
    epsilon: float


class SiloCalibrateRequest(_Request):
    """Plan `rounds` more rounds of `steps_per_round` DP-SGD steps at this silo's batch size: the
    service computes q from the registered dataset_size, as for a charge."""

    batch_size: Annotated[int, Field(ge=1, le=10**12, strict=True)]
    steps_per_round: Annotated[int, Field(ge=1, le=MAX_COUNT, strict=True)]
    rounds: Annotated[int, Field(ge=1, le=MAX_COUNT, strict=True)]

    @model_validator(mode="after")
    def _bounded_steps(self) -> SiloCalibrateRequest:
        # The plan becomes one dpsgd of rounds × steps_per_round steps, bounded like any other.
        if self.rounds * self.steps_per_round > MAX_COUNT:
            raise ValueError(
                f"rounds × steps_per_round must be at most {MAX_COUNT}. Found {self.rounds * self.steps_per_round}."
            )
        return self


class SiloCalibration(BaseModel):
    """The smallest σ (rounded up) whose planned rounds, added to what the silo has spent, stay
    within its ε at its δ. Seen only by the silo itself and admins: it is a function of the budget."""

    noise_multiplier: float
    sampling_rate: float
    rounds: int
    steps_per_round: int
    epsilon_spent: float | None = Field(description="the silo's ε before the planned rounds")
    epsilon_spent_dp_accounting: float | None = _reference("epsilon_spent")
    epsilon_after: float = Field(description="the silo's ε once every planned round is spent at this σ")
    epsilon_after_dp_accounting: float | None = _reference("epsilon_after")
    epsilon: float = Field(description="the silo's budget")


class KeyCreateRequest(_Request):
    role: Role
    silo_id: Id | None = None


class KeyCreated(BaseModel):
    key_id: int
    api_key: str


class KeyInfo(BaseModel):
    key_id: int
    role: Role
    silo_id: int | None = Field(description="the silo a silo key acts for; null for other roles")


class LevelCreateRequest(_Request):
    name: Text
    epsilon: Epsilon
    delta: Delta


class Level(BaseModel):
    name: str
    epsilon: float
    delta: float


class JobCreateRequest(_Request):
    name: Text
    silo_ids: Annotated[list[Id], Field(min_length=1, max_length=10_000)]


class JobCreated(BaseModel):
    job_id: int


class NormReportRequest(_Request):
    silo_id: Id
    l2_norm: Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
    charge_id: Id | None = Field(
        None,
        description="the charge that paid for this round; the round's reserved charges of the silo may no longer be released",
    )


class NormReported(BaseModel):
    job_id: int
    round: int
    silo_id: int
    l2_norm: float


class GroupComponent(BaseModel):
    mean_norm: float
    std_norm: float
    size: int


class GroupsResponse(BaseModel):
    groups: dict[int, int] = Field(description="silo id → privacy group; 0 is the least noisy")
    components: list[GroupComponent]
    n_components: int
