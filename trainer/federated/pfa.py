"""Aggregation by privacy group after a warm-start round (Liu et al. 2023 §4.1, Alg. 1), and PFA itself.

Liu et al. 2023 Alg. 1 line 4 ("After"): in a *warm-start* round every silo trains once from the initial
model and uploads its noisy update; the server clusters the updates' L2 norms into privacy groups
and does *not* update the global model in that round. From round 2 on (line 5) the server
aggregates the noisy updates by group. `GroupAggregated` is that round structure for any
group-wise aggregation rule; `PFA` plugs in projected federated averaging (Alg. 1 lines 14–19) and
`trainer.federated.fedhdp.FedHDP` plugs in FedHDP's two-step average (FedHDP Alg. 2).

The groups are handed in by the coordinator (`set_groups`), which gets them from the ledger's
clustering of the reported norms (`trainer.grouped`); this module never sees a budget. Privacy:
each round, each silo runs E DP-SGD steps on its data (dpsgd(q_k, σ_k, E)), the warm-start round
included; grouping and aggregating already-private updates is post-processing (Liu et al. 2023 §4.1,
"Privacy Analysis"), so the per-round cost is exactly FedAvg's.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from dpledger.trainer.aggregation import pfa_aggregate, public_mask
from dpledger.trainer.federated.base import FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.fedavg import GLOBAL, AveragingServer, GlobalModelSilo
from dpledger.trainer.federated.halves import Arrays, Halves, ServerStart, Trained

UPDATE = "update"
# Liu et al. 2023 Alg. 1: the warm-start round precedes the rounds t = 2..T of line 5.
WARM_START_ROUND = 0


def compact_groups(groups: torch.Tensor) -> torch.Tensor:
    """Renumber the groups present in `groups` (int64 [A]) to 0..G'−1, keeping their order.

    The ledger numbers groups by increasing mean norm (0 = least noisy), and the aggregation rules
    treat group 0 as the reference / public one. When every silo of a group was refused, the least
    noisy group that is still present must take that role, so gaps are closed here."""
    inverse: torch.Tensor = torch.unique(groups, sorted=True, return_inverse=True)[1]
    return inverse.to(torch.int64)


class UpdateSilo(GlobalModelSilo):
    """Trains a copy of the received global model with E DP-SGD steps and sends its noisy update."""

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        trained = self.train_global(engine, rows, received, state)
        return Trained({UPDATE: trained.upload["model"] - received[GLOBAL]}, trained.norms)


class GroupServer(AveragingServer):
    """Round `WARM_START_ROUND` only collects (Liu et al. 2023 §4.1: the silos report their norms to the
    ledger, whose clustering the coordinator reads); every later round adds the group-wise aggregate
    of the trained silos' updates to the global model, by the groups set once (`set_groups`)."""

    def __init__(self, start: ServerStart) -> None:
        super().__init__(start)
        self.groups: torch.Tensor | None = None

    def set_groups(self, groups: Sequence[int]) -> None:
        """Privacy group of each silo (0 = least noisy), as the coordinator obtained it: from the
        ledger's clustering of the warm-start norms, or from an explicit baseline assignment."""
        values = [int(g) for g in groups]
        if len(values) != self.num_silos or any(g < 0 for g in values):
            raise ValueError(f"groups must hold one group id >= 0 per silo ({self.num_silos}). Found {values}.")
        self.groups = torch.tensor(values, dtype=torch.int64)

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        if round_index == WARM_START_ROUND:
            return  # the global model stays as it was: only the norms are collected
        if self.groups is None:
            raise RuntimeError(f"Round {round_index} aggregates by privacy group: set the groups after the warm-start round.")
        updates = upload[UPDATE]
        groups = compact_groups(self.groups[members.cpu()]).to(updates.device)
        self.global_model = self.global_model + self.aggregate_updates(round_index, members, updates, groups)

    @abstractmethod
    def aggregate_updates(self, round_index: int, members: torch.Tensor, updates: torch.Tensor,
                          groups: torch.Tensor) -> torch.Tensor:
        """[A, P] noisy updates of the trained silos and their compacted groups [A] → the global
        update [P]. Post-processing of the updates; a rule that queries more (FedHDP's quantile
        query) reports it through `ServerStart.record`, and its silos declare it."""


class GroupAggregated(FederatedAlgorithm):
    """A global model trained by local DP-SGD; round `WARM_START_ROUND` only collects the updates
    (Liu et al. 2023 §4.1), every later round aggregates the approved silos' updates by privacy group.

    Every silo deploys the global model (Liu et al. 2023 reports the global model's accuracy, Fig. 4).
    The warm-start round is declared and charged like any other (E steps): the silos' data is
    queried just the same.
    """

    WARM_START_ROUND: ClassVar[int] = WARM_START_ROUND
    coordinated = True  # set_groups() after the warm-start round
    server: GroupServer

    def set_groups(self, groups: Sequence[int]) -> None:
        self.server.set_groups(groups)

    @property
    def groups(self) -> torch.Tensor | None:
        return self.server.groups

    def _check_round(self, round_index: int) -> None:
        # Checked before any silo touches its data, so a protocol error never spends budget.
        if round_index != WARM_START_ROUND and self.server.groups is None:
            raise RuntimeError(
                f"Round {round_index} aggregates by privacy group: call set_groups() after the warm-start round."
            )


class PFAServer(GroupServer):
    """Liu et al. 2023 Alg. 1 lines 14–19: the silos of the `n_public_groups` least noisy groups are
    public; the others' mean update is projected onto the top-k subspace of the public updates."""

    def __init__(self, start: ServerStart, *, k: int | None, n_public_groups: int) -> None:
        super().__init__(start)
        self.k = k
        self.n_public_groups = n_public_groups

    def aggregate_updates(self, round_index: int, members: torch.Tensor, updates: torch.Tensor,
                          groups: torch.Tensor) -> torch.Tensor:
        public = public_mask(groups, n_public_groups=self.n_public_groups).to(updates.device)
        full_rank = min(int(public.sum()), updates.shape[1])
        k = full_rank if self.k is None else min(self.k, full_rank)
        return pfa_aggregate(updates, public, k=k)


class PFA(GroupAggregated):
    """Projected federated averaging with norm-based privacy groups (Liu et al. 2023 Alg. 1).

    The silos of the `n_public_groups` least noisy groups are S_pub; the mean update of the others
    is projected onto the top-k subspace of the public updates (line 15–16) and the two means are
    combined by their sizes (line 18). `k=None` takes every direction the public updates span
    (k = |S_pub|, the largest that `pfa_aggregate` allows); a given k is capped at |S_pub| in a
    round where fewer public silos were approved. With one group every silo is public and PFA is
    FedAvg over the approved silos.
    """

    name = "pfa"
    cost = "dpsgd(B_k/n_k, σ, E), the warm-start round too"
    deploys = "global model, grouped by norm"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, k: int | None = None, n_public_groups: int = 1) -> Halves:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be None or an integer >= 1. Found {k!r}.")
        if isinstance(n_public_groups, bool) or not isinstance(n_public_groups, int) or n_public_groups < 1:
            raise ValueError(f"n_public_groups must be an integer >= 1. Found {n_public_groups!r}.")
        return Halves(UpdateSilo(config), lambda start: PFAServer(start, k=k, n_public_groups=n_public_groups))

