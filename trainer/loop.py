"""The round loop (docs/ARCHITECTURE.md, "The round protocol"): approval before every privacy-consuming step.

Per round and silo: reserve the round's mechanism (idempotency key from job, round, silo) → train →
commit. A denial is final: that silo stops spending and its model stays frozen while the run goes
on with the others. If the service becomes unreachable, reservations of the round that never touched
the data are released and the run stops without spending more. A reservation whose round ran is
never released (fail closed): a crash after training leaves it spent, as it should be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dpledger.trainer.client import Denied, LedgerClient, Rejected, Unreachable
from dpledger.trainer.federated import FederatedAlgorithm


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
    epsilon_if_approved: float | None


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


def idempotency_key(job_id: str, round_index: int, silo_id: int) -> str:
    return f"{job_id}/round-{round_index}/silo-{silo_id}"


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
        charges: dict[int, int] = {}
        refused = [False] * len(silos)
        try:
            for k, (silo, mechanism) in enumerate(zip(silos, mechanisms, strict=True)):
                if mechanism is None or run.stopped[k]:
                    continue
                try:
                    reservation = silo.client.reserve(
                        silo.silo_id, mechanism=mechanism, idempotency_key=idempotency_key(job_id, round_index, silo.silo_id),
                        job_id=job_id, round=round_index,
                    )
                except Denied as denial:
                    run.stopped[k] = refused[k] = True
                    run.refusals[k] = Refusal(round_index, denial.epsilon, denial.epsilon_spent, denial.epsilon_if_approved)
                    continue
                if not reservation.fresh:
                    # A replay of an earlier run's reservation (the same job id again): that round may
                    # have read the data already and is paid once; training it again would be unpaid.
                    run.stopped[k] = True
                    run.failed = True
                    run.stop_reason = (
                        f"silo {silo.silo_id}: round {round_index} of job {job_id!r} was reserved before (charge "
                        f"{reservation.charge_id}, {reservation.status.value}); it is not trained again: use a new job id"
                    )
                    continue
                charges[k] = reservation.charge_id
                spent[k] = reservation.epsilon_spent
        except Unreachable as error:
            _release_untouched(silos, charges)
            run.stop_reason = f"ledger unreachable before round {round_index}: {error}"
            run.failed = True
            break
        except Rejected as error:
            # A key revoked mid-run, say: this round's other reservations never touched the data.
            _release_untouched(silos, charges)
            run.stop_reason = f"the ledger rejected silo {silos[k].silo_id}'s reservation for round {round_index}: {error}"
            run.failed = True
            break

        approved = torch.zeros(len(silos), dtype=torch.bool)
        approved[list(charges)] = True
        result = algorithm.run_round(round_index, approved)
        try:
            for k, charge_id in charges.items():
                if int(result.steps[k]) > 0:
                    silos[k].client.commit(charge_id)
                else:
                    silos[k].client.release(charge_id)  # approved but never touched the data
        except (Unreachable, Rejected) as error:
            run.stop_reason = f"the ledger did not settle round {round_index}'s charges; they stay reserved (spent): {error}"
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


def _release_untouched(silos: Sequence[GatedSilo], charges: dict[int, int]) -> None:
    for k, charge_id in charges.items():
        try:
            silos[k].client.release(charge_id)
        except (Unreachable, Rejected):
            pass  # stays reserved: fail closed, an operator can release it once the service is back
