"""The coordinator's side of group-wise aggregation (docs/ARCHITECTURE.md, "The round protocol", step 3), on
top of the gated round loop `run_gated`.

Round 0 is Liu et al. 2023's warm-start round (§4.1, Alg. 1 line 4): every silo asks approval and trains
once, charged like any round; each silo reports the L2 norm of its noisy update to the ledger with
its own key; the global model is not updated. The coordinator, with a coordinator key (which reads
no budget, ε or history), then asks the ledger for round 0's groups: a Gaussian mixture over the
norms alone. Every later round aggregates by those groups (`GroupAggregated`).

The "budget-based groups" baseline (Liu et al. 2023 Alg. 1 line 3, "Before") is only possible where the
budgets' mixture components are known, i.e. in an evaluation; it is passed in explicitly as
`groups`, and the norms are still reported so that the two groupings can be compared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dpledger.trainer.federated.pfa import GroupAggregated
from dpledger.trainer.loop import GatedSilo, JobRun, RoundRecord, run_gated
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import Role

GroupSource = Literal["norms", "explicit"]


@dataclass
class GroupedRun:
    """The ledger's job id, the gated run, the groups the ledger found from the warm-start norms
    (silo id → group, 0 = least noisy), and the groups the algorithm used (per silo index)."""

    job_id: int
    source: GroupSource
    run: JobRun | None = None
    service_groups: dict[int, int] = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)


def issue_coordinator_key(admin: LedgerClient) -> str:
    """A fresh coordinator key (role `coordinator`: jobs, norms and groups only; docs/ARCHITECTURE.md, "Roles")."""
    return admin.create_key(role=Role.coordinator).api_key


def groups_by_index(service_groups: dict[int, int], silo_ids: Sequence[int]) -> list[int]:
    """The ledger's silo id → group map as a per-silo-index list. A silo with no warm-start report
    (refused in round 0, so it never trains again: a denial is final) is put in the noisiest group,
    where it can only be projected or down-weighted, never treated as public."""
    noisiest = max(service_groups.values(), default=0)
    return [service_groups.get(silo_id, noisiest) for silo_id in silo_ids]


def run_grouped(
    algorithm: GroupAggregated,
    silos: Sequence[GatedSilo],
    *,
    coordinator: LedgerClient,
    rounds: int,
    name: str,
    groups: Sequence[int] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> GroupedRun:
    """Register the job, run the warm-start round and `rounds − 1` grouped rounds, all gated.

    `groups=None`: the groups come from the ledger (norms only). Otherwise `groups[k]` is silo k's
    group (0 = least noisy), used as given: the budget-based baseline of an evaluation."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds must be an integer >= 2 (the warm-start round and one aggregation round). Found {rounds!r}.")
    if len(silos) != algorithm.num_silos:
        raise ValueError(f"silos must match the algorithm's {algorithm.num_silos} silos. Found {len(silos)}.")
    explicit = None if groups is None else [int(g) for g in groups]
    if explicit is not None and (len(explicit) != len(silos) or any(g < 0 for g in explicit)):
        raise ValueError(f"groups must hold one group id >= 0 per silo ({len(silos)}). Found {explicit}.")

    silo_ids = [s.silo_id for s in silos]
    job_id = coordinator.create_job(name=name, silo_ids=silo_ids)
    result = GroupedRun(job_id=job_id, source="norms" if explicit is None else "explicit")

    def after_round(record: RoundRecord) -> None:
        if record.round_index == algorithm.WARM_START_ROUND:
            for k, silo in enumerate(silos):
                norm = record.update_norms[k]
                if record.approved[k] and math.isfinite(norm):
                    # The silo's own key reports its own norm (the service accepts no other).
                    silo.client.report_norm(job_id, record.round_index, silo_id=silo.silo_id, l2_norm=norm)
            result.service_groups = coordinator.groups(job_id, record.round_index)
            result.groups = explicit if explicit is not None else groups_by_index(result.service_groups, silo_ids)
            algorithm.set_groups(result.groups)
        if on_round is not None:
            on_round(record)

    result.run = run_gated(algorithm, silos, rounds=rounds, job_id=f"{name}/job-{job_id}", on_round=after_round)
    return result
