"""The round loop (docs/ARCHITECTURE.md, "The round protocol"): approval before every privacy-consuming step.

Per round and silo, through the one round protocol (`trainer/silo/rounds.py`): open the round (its key
from job, round, silo; only this attempt's own reservation) → train → settle (commit when the silo
took a step, release when it provably took none). A denial is final: that silo stops spending and
its model stays frozen while the run goes on with the others. If the service becomes unreachable,
the round's permits that never touched the data are released and the run stops without spending
more. A reservation whose round ran is never released (fail closed): a crash after training leaves
it spent, as it should be. A SIGINT (KeyboardInterrupt) settles the round in flight by the same rule
and raises `Interrupted`; a `RoundJournal` keeps each trained round before its charges are committed,
so that `dpledger train --resume` never trains a committed round again (`trainer/resume.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dpledger.trainer.federated import FederatedAlgorithm
from dpledger.trainer.silo.rounds import Permit, open_round
from dpledger.wire.client import LedgerClient, Reservation
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Denied, LedgerError, NotOwned, Rejected, Unreachable


@dataclass(frozen=True)
class GatedSilo:
    """A silo as the worker sees it: its ledger id and a client holding that silo's own key."""

    silo_id: int
    client: LedgerClient


@dataclass(frozen=True)
class RoundRecord:
    round_index: int
    approved: list[bool]
    refused: list[bool]
    epsilon_spent: list[float]
    metric: list[float]
    update_norms: list[float]


@dataclass(frozen=True)
class Refusal:
    """The ledger's 409 for one silo: what it had spent and what the round would have made it."""

    round_index: int
    budget: float
    epsilon_spent: float | None
    epsilon_if_approved: float | None  # the gate's reading: what the ledger would have charged
    epsilon_dp_accounting: float | None = None  # dp-accounting's of the same charges, for reference


@dataclass
class JobRun:
    job_id: str
    rounds: list[RoundRecord] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # the silo was refused and spends no more
    stop_reason: str | None = None
    refusals: dict[int, Refusal] = field(default_factory=dict)  # silo index → its refusal
    failed: bool = False  # stopped by the ledger's silence or a rejected request, not by budgets
    interrupted: Interruption | None = None  # stopped by SIGINT/SIGTERM (then `run_gated` raised Interrupted)

    def approved_rounds(self) -> list[int]:
        return [sum(r.approved[k] for r in self.rounds) for k in range(len(self.stopped))]

    def refused_rounds(self) -> list[int]:
        return [sum(r.refused[k] for r in self.rounds) for k in range(len(self.stopped))]


class RoundJournal(Protocol):
    """Where a job keeps what survives an interruption (`trainer/resume.py`): told before a round's
    training may touch data, and after it trained (before its charges are settled)."""

    def training(self, round_index: int) -> None: ...

    def completed(self, round_index: int, algorithm: FederatedAlgorithm, run: JobRun) -> None: ...


Pause = Callable[[str, int], None]  # a test's hold at a point of a round (trainer/pause.py)


@dataclass(frozen=True)
class Interruption:
    """How a SIGINT/SIGTERM found the run: the round in flight (from 0) and its charges as left."""

    round_index: int
    read: bool  # the round may have read data when it was stopped: its charges are committed
    committed: list[int]
    released: list[int]
    reserved: list[int]  # could not be settled (the ledger did not answer, or a second interrupt): spent


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt (SIGINT, or SIGTERM where the caller maps it so) that stopped `run_gated`
    after it settled the round in flight; `run` holds the rounds completed and `run.interrupted`."""

    def __init__(self, run: JobRun) -> None:
        super().__init__("interrupted")
        self.run = run


@dataclass(frozen=True)
class Start:
    """Where a resumed run starts: its first round, the run as checkpointed so far, and for each
    (round, silo position) the number of the charge its next reservation makes (`round_key`)."""

    first_round: int = 0
    run: JobRun | None = None
    charges: Mapping[tuple[int, int], int] = field(default_factory=dict)


def run_gated(
    algorithm: FederatedAlgorithm,
    silos: Sequence[GatedSilo],
    *,
    rounds: int,
    job_id: str,
    on_round: Callable[[RoundRecord], None] | None = None,
    start: Start | None = None,
    journal: RoundJournal | None = None,
    pause: Pause | None = None,
) -> JobRun:
    """Raises `Interrupted` on a KeyboardInterrupt, once the round in flight is settled by the one
    settle rule: committed if its training may have begun, released if it provably had not."""
    if len(silos) != algorithm.num_silos:
        raise ValueError(f"silos must match the algorithm's {algorithm.num_silos} silos. Found {len(silos)}.")
    start = start or Start()
    run = start.run if start.run is not None else JobRun(job_id=job_id, stopped=[False] * len(silos))
    spent = list(run.rounds[-1].epsilon_spent) if run.rounds else [0.0] * len(silos)
    hold: Pause = pause or (lambda point, index: None)
    for round_index in range(start.first_round, rounds):
        if all(run.stopped):
            if run.stop_reason is None:  # else it says why a silo stopped other than by its budget
                run.stop_reason = "the ledger refused every silo's next round: it would exceed the silo's budget"
            break
        permits: dict[int, Permit] = {}
        reserving: int | None = None
        read = False  # set before the round's training may touch any silo's data
        try:
            hold("before-reserve", round_index)
            mechanisms = algorithm.round_mechanisms(round_index)
            refused = [False] * len(silos)
            try:
                for k, (silo, mechanism) in enumerate(zip(silos, mechanisms, strict=True)):
                    if mechanism is None or run.stopped[k]:
                        continue
                    reserving = k
                    try:
                        permit = open_round(silo.client, silo_id=silo.silo_id, job_id=job_id, round=round_index,
                                            mechanism=mechanism, charge=start.charges.get((round_index, k), 0))
                    except Denied as denial:
                        run.stopped[k] = refused[k] = True
                        run.refusals[k] = Refusal(round_index, denial.epsilon, denial.epsilon_spent,
                                                  denial.epsilon_if_approved, denial.epsilon_dp_accounting)
                        continue
                    except NotOwned as replay:
                        # Reserved before (the same job id again): that round may have read the data already
                        # and is paid once; training it again would be unpaid.
                        run.stopped[k] = True
                        run.failed = True
                        run.stop_reason = f"silo {silo.silo_id}: {replay}; use a new job id"
                        continue
                    permits[k] = permit
                    reserving = None  # only once held: an interrupt in between finds the charge on the ledger
                    spent[k] = permit.reservation.epsilon_spent
            except Unreachable as error:
                _settle_untouched(permits)
                run.stop_reason = f"ledger unreachable before round {round_index + 1}: {error}"
                run.failed = True
                break
            except Rejected as error:
                # A key revoked mid-run, say: this round's other reservations never touched the data.
                _settle_untouched(permits)
                run.stop_reason = (f"the ledger rejected silo {silos[k].silo_id}'s reservation for round "
                                   f"{round_index + 1}: {error}")
                run.failed = True
                break
            hold("after-reserve", round_index)

            approved = torch.zeros(len(silos), dtype=torch.bool)
            approved[list(permits)] = True
            if permits and journal is not None:
                journal.training(round_index)  # on disk before any data is read: else its charges are released
            read = bool(permits)
            with _held_mid_training(algorithm, functools.partial(hold, "mid-training", round_index)) if pause else nullcontext():
                result = algorithm.run_round(round_index, approved)
            record = RoundRecord(
                round_index=round_index,
                approved=approved.tolist(),
                refused=refused,
                epsilon_spent=list(spent),
                metric=algorithm.evaluate().tolist(),
                update_norms=result.update_norms.tolist(),
            )
            run.rounds.append(record)
            if journal is not None:
                journal.completed(round_index, algorithm, run)  # before the commit: a committed round is never lost
            try:
                for k, permit in permits.items():
                    if bool(result.trained[k]):  # any query of its data: spent
                        permit.touch()
                    permit.settle()  # released when the silo was approved but took no step
            except (Unreachable, Rejected) as error:
                run.stop_reason = (f"the ledger did not settle round {round_index + 1}'s charges; they stay reserved "
                                   f"(spent): {error}")
                run.failed = True
                break
            permits, read = {}, False  # settled: an interrupt from here on finds nothing open
            hold("after-commit", round_index)
            if on_round is not None:
                on_round(record)
        except KeyboardInterrupt:
            run.interrupted = _settle_interrupted(round_index, permits, silos, job_id, read=read, reserving=reserving)
            raise Interrupted(run) from None
    return run


@contextmanager
def _held_mid_training(algorithm: FederatedAlgorithm, hold: Callable[[], None]) -> Iterator[None]:
    """Calls `hold` right after the round's first query of a silo's data is metered (a test's
    "mid training"), through the meter every query goes through; the meter is left as it was."""
    meter = algorithm.meter
    real = meter.record

    def record(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        meter.__dict__.pop("record", None)  # once: the checkpoint pickles the meter, never this function
        hold()

    meter.__dict__["record"] = record  # an instance attribute shadows the method until popped below
    try:
        yield
    finally:
        meter.__dict__.pop("record", None)


def _settle_interrupted(round_index: int, permits: dict[int, Permit], silos: Sequence[GatedSilo], job_id: str, *,
                        read: bool, reserving: int | None) -> Interruption:
    """The one settle rule for the round a SIGINT stopped: commit every charge once the round may have
    read data, release them only when its training had not begun. A reservation whose answer the
    interrupt cut off is found by the ledger's list of the silo's open charges and released too
    (training had not begun). A second interrupt stops the settling: what is left stays reserved."""
    committed: list[int] = []
    released: list[int] = []
    reserved: list[int] = []
    pending = list(permits.values())
    try:
        if reserving is not None and not read:
            silo = silos[reserving]
            held = {p.charge_id for p in pending}
            for charge in silo.client.charges(silo.silo_id, status=ChargeStatus.reserved):
                if charge.job_id == job_id and charge.round == round_index and charge.charge_id not in held:
                    pending.append(Permit(silo.client, silo.silo_id, job_id, round_index, Reservation(
                        charge_id=charge.charge_id, epsilon_spent=0.0, epsilon_remaining=charge.epsilon_remaining)))
        while pending:
            permit = pending[0]
            if read:
                permit.touch()
            try:
                status = permit.settle()
            except LedgerError:
                status = ChargeStatus.reserved
            (committed if status is ChargeStatus.committed else released if status is ChargeStatus.released
             else reserved).append(permit.charge_id)
            pending.pop(0)
    except (KeyboardInterrupt, LedgerError):
        reserved.extend(p.charge_id for p in pending)
    return Interruption(round_index, read, committed, released, reserved)


def _settle_untouched(permits: dict[int, Permit]) -> None:
    for permit in permits.values():
        try:
            permit.settle()  # none was touched: each is released
        except LedgerError:
            pass  # stays reserved: fail closed, an operator can release it once the service is back
