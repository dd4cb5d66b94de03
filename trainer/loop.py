"""The round loop (DESIGN.md, "The round protocol"): approval before every privacy-consuming step.

Per round and silo: reserve the round's mechanism (idempotency key from job, round, silo) → train →
commit. A denial is final: that silo stops spending and its model stays frozen while the run goes
on with the others. If the service becomes unreachable, reservations of the round that never touched
the data are released and the run stops without spending more. A reservation whose round ran is
never released (fail closed): a crash after training leaves it spent, as it should be.

A silo trains only on a fresh reservation (`Reservation.fresh`): a replay of a charge this run did
not just obtain (committed, released, or held by another run under the same job id) runs no step.
Before round 0 each silo's registered dataset_size is checked against the records it samples from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dpledger.trainer.client import Denied, LedgerClient, Unreachable
from dpledger.trainer.federated import FederatedAlgorithm


@dataclass(frozen=True)
class GatedSilo:
    """A silo as the worker sees it: its ledger id and a client holding that silo's own key."""

    silo_id: int
    client: LedgerClient


class RegisteredSizeError(ValueError):
    """The ledger's registered dataset_size is larger than the records the silo samples from: the
    ledger would divide by too many records and under-charge every round."""


@dataclass(frozen=True)
class RoundRecord:
    round_index: int
    approved: list[bool]
    refused: list[bool]
    epsilon_spent: list[float]
    metric: list[float]
    update_norms: list[float]


@dataclass
class JobRun:
    job_id: str
    rounds: list[RoundRecord] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # the silo was refused and spends no more
    stop_reason: str | None = None

    def approved_rounds(self) -> list[int]:
        return [sum(r.approved[k] for r in self.rounds) for k in range(len(self.stopped))]

    def refused_rounds(self) -> list[int]:
        return [sum(r.refused[k] for r in self.rounds) for k in range(len(self.stopped))]


def idempotency_key(job_id: str, round_index: int, silo_id: int) -> str:
    return f"{job_id}/round-{round_index}/silo-{silo_id}"


def check_registered_sizes(silos: Sequence[GatedSilo], train_sizes: Sequence[int]) -> None:
    """q = batch / registered size is only an upper bound on the real rate when the registered size
    is at most the records actually sampled from (the training split)."""
    for silo, records in zip(silos, train_sizes, strict=True):
        registered = int(silo.client.silo(silo.silo_id)["dataset_size"])
        if registered > records:
            raise RegisteredSizeError(
                f"silo {silo.silo_id}: the ledger's registered dataset_size {registered} is larger than the {records} "
                f"training records this worker samples from; register the silo with dataset_size at most {records}"
            )


def committed_rounds(silos: Sequence[GatedSilo], *, job_id: str) -> list[set[int]]:
    """Per silo, the rounds of `job_id` whose charges the ledger holds committed: a resumed run skips them."""
    return [
        {int(c["round"]) for c in silo.client.charges(silo.silo_id, job_id=job_id, status="committed") if c["round"] is not None}
        for silo in silos
    ]


def run_gated(
    algorithm: FederatedAlgorithm,
    silos: Sequence[GatedSilo],
    *,
    rounds: int,
    job_id: str,
    on_round: Callable[[RoundRecord], None] | None = None,
    done: Mapping[int, set[int]] | None = None,
) -> JobRun:
    """`done[k]`: rounds silo k already committed under this job id (a resumed run), skipped."""
    if len(silos) != algorithm.num_silos:
        raise ValueError(f"silos must match the algorithm's {algorithm.num_silos} silos. Found {len(silos)}.")
    check_registered_sizes(silos, algorithm.train.sizes)
    run = JobRun(job_id=job_id, stopped=[False] * len(silos))
    spent = [0.0] * len(silos)
    done = done or {}
    for round_index in range(rounds):
        if all(run.stopped):
            run.stop_reason = "every silo's budget is spent"
            break
        skip = [round_index in done.get(k, set()) for k in range(len(silos))]
        if all(skip):
            continue  # committed by the run this one resumes: not retrained
        mechanisms = algorithm.round_mechanisms(round_index)
        charges: dict[int, int] = {}
        refused = [False] * len(silos)
        try:
            for k, (silo, mechanism) in enumerate(zip(silos, mechanisms, strict=True)):
                if mechanism is None or run.stopped[k] or skip[k]:
                    continue
                try:
                    reservation = silo.client.reserve(
                        silo.silo_id, mechanism=mechanism, idempotency_key=idempotency_key(job_id, round_index, silo.silo_id),
                        job_id=job_id, round=round_index,
                    )
                except Denied:
                    run.stopped[k] = refused[k] = True
                    continue
                if not reservation.fresh:
                    # A charge some earlier call holds: no new approval, so no step (and no settling
                    # of a charge this call did not obtain).
                    continue
                charges[k] = reservation.charge_id
                spent[k] = reservation.epsilon_spent
        except Unreachable as error:
            _release_untouched(silos, charges)
            run.stop_reason = f"ledger unreachable before round {round_index}: {error}"
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
        except Unreachable as error:
            run.stop_reason = f"ledger unreachable after round {round_index}; its charges stay reserved: {error}"
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
        except Unreachable:
            pass  # stays reserved: fail closed, an operator can release it once the service is back
