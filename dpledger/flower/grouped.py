"""Group-wise aggregation on the ServerApp: PFA (Liu et al. 2023 Alg. 1) and FedHDP (FedHDP Alg. 2) with
the privacy groups the ledger found from the warm-start round's norms (Liu et al. 2023 §4.1).

Round `WARM_START_ROUND` is charged like any round and every silo trains from the initial model;
each silo's mod reports its noisy update's norm to the ledger with the silo's own key, and the
server does not update the global model. The ServerApp then reads the round's groups once, with its
coordinator key (a route that clusters norms and reads no budget), and keeps them for every later
round: no re-clustering. Aggregating already-private updates by group is post-processing (Liu et al.
2023 §4.1, "Privacy Analysis"), so each round costs a silo exactly what a FedAvg round does.

The aggregation is the algorithm's server half (`PFAServer`, `FedHDPServer`), the same as in the
simulator; this module only fixes the groups it aggregates by.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dpledger.trainer.federated.pfa import GroupAggregated
from dpledger.trainer.grouped import groups_by_index

WARM_START_ROUND = GroupAggregated.WARM_START_ROUND


def fixed_groups(service_groups: Mapping[int, int], silo_ids: Sequence[int]) -> dict[int, int]:
    """Silo id → group for every silo of the job, from the ledger's answer for the warm-start round.
    A silo that reported no norm there (declined, or gone) goes to the noisiest group, where PFA
    projects it and FedHDP down-weighs it: it is never taken as public (`trainer.grouped`)."""
    ordered = list(silo_ids)
    return dict(zip(ordered, groups_by_index(dict(service_groups), ordered), strict=True))
