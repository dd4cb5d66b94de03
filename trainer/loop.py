"""The round loop (docs/ARCHITECTURE.md, "The round protocol"): approval before every privacy-consuming step.

Per round and silo, through the one round protocol (`trainer/rounds.py`): open the round (its key
from job, round, silo; only this attempt's own reservation) → train → settle (commit when the silo
took a step, release when it provably took none). A denial is final: that silo stops spending and
its model stays frozen while the run goes on with the others. If the service becomes unreachable,
the round's permits that never touched the data are released and the run stops without spending
more. A reservation whose round ran is never released (fail closed): a crash after training leaves
it spent, as it should be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dpledger.trainer.federated import FederatedAlgorithm
from dpledger.trainer.rounds import Permit, open_round
from dpledger.wire.client import LedgerClient
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

    def approved_rounds(self) -> list[int]:
        return [sum(r.approved[k] for r in self.rounds) for k in range(len(self.stopped))]

    def refused_rounds(self) -> list[int]:
        return [sum(r.refused[k] for r in self.rounds) for k in range(len(self.stopped))]


def run_gated(
    algorithm: FederatedAlgorithm,
    silos: Sequence[GatedSilo],
    *,
    rounds: int,
    job_id: str,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> JobRun:
    if len(silos) != algorithm.num_silos:
        raise ValueError(f"silos must match the algorithm's {algorithm.num_silos} silos. Found {len(silos)}.")
    run = JobRun(job_id=job_id, stopped=[False] * len(silos))
    spent = [0.0] * len(silos)
    for round_index in range(rounds):
        if all(run.stopped):
            if run.stop_reason is None:  # else it says why a silo stopped other than by its budget
                run.stop_reason = "the ledger refused every silo's next round: it would exceed the silo's budget"
            break
        mechanisms = algorithm.round_mechanisms(round_index)
        permits: dict[int, Permit] = {}
        refused = [False] * len(silos)
        try:
            for k, (silo, mechanism) in enumerate(zip(silos, mechanisms, strict=True)):
                if mechanism is None or run.stopped[k]:
                    continue
                try:
                    permit = open_round(silo.client, silo_id=silo.silo_id, job_id=job_id, round=round_index,
                                        mechanism=mechanism)
                except Denied as denial:
                    run.stopped[k] = refused[k] = True
                    run.refusals[k] = Refusal(round_index, denial.epsilon, denial.epsilon_spent, denial.epsilon_if_approved,
                                                 denial.epsilon_dp_accounting)
                    continue
                except NotOwned as replay:
                    # Reserved before (the same job id again): that round may have read the data already
                    # and is paid once; training it again would be unpaid.
                    run.stopped[k] = True
                    run.failed = True
                    run.stop_reason = f"silo {silo.silo_id}: {replay}; use a new job id"
                    continue
                permits[k] = permit
                spent[k] = permit.reservation.epsilon_spent
        except Unreachable as error:
            _settle_untouched(permits)
            run.stop_reason = f"ledger unreachable before round {round_index + 1}: {error}"
            run.failed = True
            break
        except Rejected as error:
            # A key revoked mid-run, say: this round's other reservations never touched the data.
            _settle_untouched(permits)
            run.stop_reason = f"the ledger rejected silo {silos[k].silo_id}'s reservation for round {round_index + 1}: {error}"
            run.failed = True
            break

        approved = torch.zeros(len(silos), dtype=torch.bool)
        approved[list(permits)] = True
        result = algorithm.run_round(round_index, approved)
        try:
            for k, permit in permits.items():
                if bool(result.trained[k]):  # any query of its data: spent
                    permit.touch()
                permit.settle()  # released when the silo was approved but took no step
        except (Unreachable, Rejected) as error:
            run.stop_reason = f"the ledger did not settle round {round_index + 1}'s charges; they stay reserved (spent): {error}"
            run.failed = True
            break

        record = RoundRecord(
            round_index=round_index,
            approved=approved.tolist(),
            refused=refused,
            epsilon_spent=list(spent),
            metric=algorithm.evaluate().tolist(),
            update_norms=result.update_norms.tolist(),
        )
        run.rounds.append(record)
        if on_round is not None:
            on_round(record)
    return run


def _settle_untouched(permits: dict[int, Permit]) -> None:
    for permit in permits.values():
        try:
            permit.settle()  # none was touched: each is released
        except LedgerError:
            pass  # stays reserved: fail closed, an operator can release it once the service is back
