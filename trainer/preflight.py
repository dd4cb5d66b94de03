"""Before round 0 of `dpledger train`: the ledger's view of every silo, checked with that silo's own
key, and the plan (what a round costs each silo, and how many rounds its remaining budget buys).

httpx only (no torch): a wrong key, an unknown silo id, a re-used job id or a ledger that is down is
one line per silo before any data is loaded. Every ε here is the service's own (POST /v1/quote/rounds
with the silo's key, read by its gate), so the plan and the approvals cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpledger.trainer.job_config import JobConfig, SiloKey, silo_key
from dpledger.trainer.silo.registered import size_mismatch
from dpledger.wire.client import LedgerClient, Retry
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Rejected, Unreachable
from dpledger.wire.schemas import SiloDetail

PREFLIGHT_RETRY = Retry(window=1.0, first_delay=0.2)  # a ledger that is down is said in ~1 s, not ~6
HISTORY_PAGE = 10_000


class PreflightError(Exception):
    """What the ledger said about the job's silos, one problem a line; `unreachable` when it said nothing."""

    def __init__(self, problems: Sequence[str], *, unreachable: bool = False) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)
        self.unreachable = unreachable


@dataclass(frozen=True)
class LedgerSilo:
    """A silo as the ledger sees it (GET /v1/silos/{id} with its own key)."""

    id: int
    name: str
    epsilon: float
    delta: float
    dataset_size: int
    epsilon_spent: float | None  # None: unbounded (the API's null)
    epsilon_remaining: float
    epsilon_dp_accounting: float | None = None  # for reference: dp-accounting's ε of what is spent

    @property
    def label(self) -> str:
        return f"silo {self.id} ({self.name})"


def _detail(error: Rejected) -> str:
    body = error.body
    return str(body.get("detail")) if isinstance(body, dict) and "detail" in body else str(body)


def check_silos(job: JobConfig, environ: Mapping[str, str]) -> list[LedgerSilo]:
    """Each [[silos]] entry: its key is a live silo key, for that very silo, which exists; and no
    charge of this job id is in its history yet (a re-run under the same id would replay the old
    reservations and train again unpaid), unless the job resumes that run."""
    problems: list[str] = []
    found: list[LedgerSilo] = []
    for index, entry in enumerate(job.silos):
        where = f"silos[{index}] (id {entry.id})"
        with LedgerClient(job.url, silo_key(entry, environ), retry=PREFLIGHT_RETRY, timeout=10.0) as client:
            try:
                problem = _check_key(client, entry)
                if problem is None:
                    silo = ledger_silo(client.silo(entry.id))
                    found.append(silo)
                    # A resumed run settles the job's charges itself (trainer/resume.py).
                    problem = None if job.resume else _check_job_unused(client, silo, job.job_id)
            except Unreachable as error:
                raise PreflightError([f"cannot reach the ledger at {job.url} (url): {error}"], unreachable=True) from None
            except Rejected as error:
                problem = f"the ledger refused to show silo {entry.id}: HTTP {error.status_code}: {_detail(error)}"
        if problem is not None:
            problems.append(f"{where}: {problem}")
    if problems:
        raise PreflightError(problems)
    return found


def _check_key(client: LedgerClient, entry: SiloKey) -> str | None:
    try:
        me = client.who_am_i()
    except Rejected as error:
        if error.status_code == 401:
            return f"the key in {entry.key_source} is unknown to this ledger or revoked"
        raise
    if me.role != "silo":
        return f"{entry.key_source} holds an {me.role.value} key; each silo trains with its own silo key"
    if me.silo_id != entry.id:
        return f"{entry.key_source} holds silo {me.silo_id}'s key, not silo {entry.id}'s: fix the id or the variable"
    return None


def ledger_silo(body: SiloDetail) -> LedgerSilo:
    return LedgerSilo(
        id=body.id, name=body.name, epsilon=body.epsilon, delta=body.delta, dataset_size=body.dataset_size,
        epsilon_spent=body.epsilon_spent, epsilon_remaining=body.epsilon_remaining,
        epsilon_dp_accounting=body.epsilon_dp_accounting,
    )


def _check_job_unused(client: LedgerClient, silo: LedgerSilo, job_id: str) -> str | None:
    after, rounds = 0, set()
    while True:
        page = client.history_page(silo.id, after_seq=after, limit=HISTORY_PAGE)
        rounds |= {e.round for e in page if e.job_id == job_id and e.event == "reserve"}
        if len(page) < HISTORY_PAGE:
            break
        after = page[-1].seq
    if not rounds:
        return None
    known = sorted(r for r in rounds if r is not None)
    span = f" (rounds {known[0] + 1}–{known[-1] + 1})"  # the ledger keeps indices from 0 if known else ""
    open_charges = [c for c in client.charges(silo.id, status=ChargeStatus.reserved) if c.job_id == job_id]
    held = "" if not open_charges else "; open reservations: " + ", ".join(
        f"charge {c.charge_id}" + ("" if c.round is None else f" (round {c.round + 1})") for c in open_charges)
    return (f"{silo.label} already has charges of job_id {job_id!r}{span}{held}: continue that run with --resume "
            "(or resume = true), or give this run a new job_id")


def check_sizes(silos: Sequence[LedgerSilo], n_train: Sequence[int]) -> list[str]:
    """Every silo whose data breaks the registered-size rule (`registered.size_mismatch`), so the run is
    refused before any round reserves (fail closed)."""
    return [
        f"{silo.label}: {reason}"
        for silo, n in zip(silos, n_train, strict=True)
        if (reason := size_mismatch(registered=silo.dataset_size, records=n)) is not None
    ]


# --- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    gate: float | None
    dp_accounting: float | None

    def __str__(self) -> str:
        def shown(value: float | None) -> str:
            return "inf" if value is None else f"{value:.4g}"

        return f"{shown(self.gate)} ({shown(self.dp_accounting)})"


@dataclass(frozen=True)
class SiloPlan:
    silo: LedgerSilo
    # The silo's ε now, after the job's first charged round and after all of its rounds: the gate's reading
    # (what the ledger states and charges) and, for reference, dp-accounting's non-adaptive RDP ε of
    # the same charges (None: unbounded).
    spent: Reading
    after_first: Reading
    after_rounds: Reading
    affordable_rounds: int  # rounds its remaining budget buys, at most `horizon`
    horizon: int  # the most rounds searched
    noise_multiplier: float | None = None  # with calibrate: the ledger's σ for all the job's rounds


def runs(mechanisms: Sequence[Mapping[str, Any] | None]) -> list[tuple[Mapping[str, Any] | None, int]]:
    """Consecutive equal rounds as (mechanism, count), so that a thousand rounds are a short request."""
    found: list[tuple[Mapping[str, Any] | None, int]] = []
    for mechanism in mechanisms:
        if found and found[-1][0] == mechanism:
            found[-1] = (mechanism, found[-1][1] + 1)
        else:
            found.append((mechanism, 1))
    return found


def plan_silo(
    client: LedgerClient, silo: LedgerSilo, mechanisms: Sequence[Mapping[str, Any] | None], *, rounds: int,
    calibrate: bool = False,
) -> SiloPlan:
    """How many of `mechanisms` (the job's rounds, in order, up to the horizon searched) the silo's
    remaining budget buys, in one request (POST /v1/quote/rounds): the ledger reads each candidate
    with the silo's own gate, as it will approve the rounds one by one."""
    quote = client.quote_rounds(silo.id, runs(mechanisms), rounds=rounds, calibrate=calibrate)
    return SiloPlan(
        silo=silo, spent=Reading(quote.epsilon_spent, quote.epsilon_spent_dp_accounting),
        after_first=Reading(quote.epsilon_after_first_round, quote.epsilon_after_first_round_dp_accounting),
        after_rounds=Reading(quote.epsilon_after_rounds, quote.epsilon_after_rounds_dp_accounting),
        affordable_rounds=quote.affordable_rounds, horizon=quote.horizon, noise_multiplier=quote.noise_multiplier,
    )


def sigma_up(sigma: float, digits: int = 4) -> str:
    """σ shown to `digits` significant digits, rounded up: a rounded-down σ could overspend."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(sigma)))
    return f"{math.ceil(sigma * scale - 1e-9) / scale:.{digits}g}"


EPSILON_LEGEND = ("ε: the ledger's gate, what it states and charges (proven under adaptive choices); in brackets, "
               "dp-accounting's non-adaptive RDP ε of the same charges, for reference only")


def format_plan(plans: Sequence[SiloPlan], *, rounds: int, sigmas: Sequence[float | None] | None = None) -> str:
    header: tuple[str, ...] = ("silo", "name", "ε budget", "ε spent", "ε after round 1", f"ε after round {rounds}",
                               "rounds its budget buys")
    if sigmas is not None:
        header = (*header, f"σ for all {rounds} rounds")
    rows: list[tuple[str, ...]] = []
    for index, p in enumerate(plans):
        bought = f"≥ {p.horizon}" if p.affordable_rounds >= p.horizon else str(p.affordable_rounds)
        row: tuple[str, ...] = (str(p.silo.id), p.silo.name, f"{p.silo.epsilon:.4g}", str(p.spent), str(p.after_first),
                                str(p.after_rounds), bought)
        if sigmas is not None:
            sigma = sigmas[index]
            row = (*row, "—" if sigma is None else sigma_up(sigma))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
    return "\n".join([*lines, EPSILON_LEGEND])
