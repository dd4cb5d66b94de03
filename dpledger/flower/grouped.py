"""Group-wise aggregation on the ServerApp: PFA (Liu et al. 2023 Alg. 1) and FedHDP (FedHDP Alg. 2) with
the privacy groups the ledger found from the warm-start round's norms (Liu et al. 2023 §4.1).

Round `WARM_START_ROUND` is charged like any round and every silo trains from the initial model;
each silo's mod reports its noisy update's norm to the ledger with the silo's own key, and the
server does not update the global model. The ServerApp then reads the round's groups once, with its
coordinator key (a route that clusters norms and reads no budget), and keeps them for every later
round: no re-clustering. Aggregating already-private updates by group is post-processing (Liu et al.
2023 §4.1, "Privacy Analysis"), so each round costs a silo exactly what a FedAvg round does.

The aggregation rules are the trainer's (`pfa_aggregate`, `fedhdp_aggregate`); this module only maps
Flower's silos onto them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dpledger.trainer.aggregation import fedhdp_aggregate, pfa_aggregate, public_mask
from dpledger.trainer.federated.fedhdp import blind_group_ratios
from dpledger.trainer.federated.pfa import GroupAggregated, compact_groups
from dpledger.trainer.grouped import groups_by_index

GROUPED = ("pfa", "fedhdp")
WARM_START_ROUND = GroupAggregated.WARM_START_ROUND


def fixed_groups(service_groups: Mapping[int, int], silo_ids: Sequence[int]) -> dict[int, int]:
    """Silo id → group for every silo of the job, from the ledger's answer for the warm-start round.
    A silo that reported no norm there (declined, or gone) goes to the noisiest group, where PFA
    projects it and FedHDP down-weighs it: it is never taken as public (`trainer.grouped`)."""
    ordered = list(silo_ids)
    return dict(zip(ordered, groups_by_index(dict(service_groups), ordered), strict=True))


def aggregate(algorithm: str, updates: torch.Tensor, groups: Sequence[int]) -> torch.Tensor:
    """The global update [P] from the [A, P] updates of the silos that trained this round and their
    fixed groups. Groups are compacted first, so that the least noisy group still present is the
    public / reference one when every silo of a less noisy group has stopped."""
    if updates.dim() != 2 or updates.shape[0] != len(groups):
        raise ValueError(f"one group per update: {len(groups)} groups for updates of shape {tuple(updates.shape)}")
    compact = compact_groups(torch.tensor(list(groups), dtype=torch.int64))
    if algorithm == "pfa":
        # Liu et al. 2023 Alg. 1 lines 14–19: the least noisy group is public; the others' mean update is
        # projected onto the span of the public updates (k = every direction they span).
        public = public_mask(compact, n_public_groups=1)
        return pfa_aggregate(updates, public, k=min(int(public.sum()), updates.shape[1]))
    if algorithm == "fedhdp":
        # FedHDP Alg. 2 step 2 with r estimated from the updates (the coordinator has no budget).
        return fedhdp_aggregate(updates, compact, ratios=blind_group_ratios(updates, compact))
    raise ValueError(f"algorithm must be one of {list(GROUPED)}. Found {algorithm!r}.")
