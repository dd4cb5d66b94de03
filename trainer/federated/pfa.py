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
from typing import ClassVar, Unpack

import torch

from dpledger.trainer.aggregation import pfa_aggregate, public_mask
from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import RoundResult


def compact_groups(groups: torch.Tensor) -> torch.Tensor:
    """Renumber the groups present in `groups` (int64 [A]) to 0..G'−1, keeping their order.

    The ledger numbers groups by increasing mean norm (0 = least noisy), and the aggregation rules
    treat group 0 as the reference / public one. When every silo of a group was refused, the least
    noisy group that is still present must take that role, so gaps are closed here."""
    inverse: torch.Tensor = torch.unique(groups, sorted=True, return_inverse=True)[1]
    return inverse.to(torch.int64)


class GroupAggregated(FederatedAlgorithm):
    """A global model trained by local DP-SGD; round `WARM_START_ROUND` only collects the updates
    (Liu et al. 2023 §4.1), every later round aggregates the approved silos' updates by privacy group.

    Every silo deploys the global model (Liu et al. 2023 reports the global model's accuracy, Fig. 4).
    The warm-start round is declared and charged like any other (the base class's E steps per
    round): the silos' data is queried just the same.
    """

    # Liu et al. 2023 Alg. 1: the warm-start round precedes the rounds t = 2..T of line 5.
    WARM_START_ROUND: ClassVar[int] = 0
    coordinated = True  # set_groups() after the warm-start round

    def __init__(self, **common: Unpack[AlgorithmArgs]) -> None:
        super().__init__(**common)
        self.global_model = self.initial.clone()
        # The model each silo last trained locally (its upload); a refused silo keeps its last one.
        self.local = self.initial.expand(self.num_silos, -1).clone()
        self.groups: torch.Tensor | None = None

    def set_groups(self, groups: Sequence[int]) -> None:
        """Privacy group of each silo (0 = least noisy), as the coordinator obtained it: from the
        ledger's clustering of the warm-start norms, or from an explicit baseline assignment."""
        values = [int(g) for g in groups]
        if len(values) != self.num_silos or any(g < 0 for g in values):
            raise ValueError(f"groups must hold one group id >= 0 per silo ({self.num_silos}). Found {values}.")
        self.groups = torch.tensor(values, dtype=torch.int64)

    def run_round(self, round_index: int, approved: torch.Tensor) -> RoundResult:
        # Checked before any silo touches its data, so a protocol error never spends budget.
        if round_index != self.WARM_START_ROUND and self.groups is None:
            raise RuntimeError(
                f"Round {round_index} aggregates by privacy group: call set_groups() after the warm-start round."
            )
        return super().run_round(round_index, approved)

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        start = self.global_model.expand(len(silos), -1)
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps)
        self.local[silos] = trained
        updates = trained - start
        if round_index != self.WARM_START_ROUND:
            assert self.groups is not None  # run_round checked it before training
            groups = compact_groups(self.groups[silos.cpu()]).to(updates.device)
            self.global_model = self.global_model + self._aggregate_updates(round_index, silos, updates, groups)
        # Liu et al. 2023 §4.1: in the warm-start round the server only collects the noisy updates, whose
        # norms are what the coordinator clusters; the global model stays as it was.
        return update_norms(updates)

    @abstractmethod
    def _aggregate_updates(
        self, round_index: int, silos: torch.Tensor, updates: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        """[A, P] noisy updates of the approved silos `silos` and their compacted groups [A] → the
        global update [P]. Post-processing of the updates; a rule that queries more (FedHDP's
        quantile query) declares it in `extra_queries` and records it in the meter."""

    def deployed_parameters(self) -> torch.Tensor:
        return self.global_model.expand(self.num_silos, -1)

    def state(self) -> dict[str, torch.Tensor]:
        return {"global": self.global_model.clone(), "local": self.local.clone()}


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

    def __init__(self, *, k: int | None = None, n_public_groups: int = 1, **common: Unpack[AlgorithmArgs]) -> None:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be None or an integer >= 1. Found {k!r}.")
        if isinstance(n_public_groups, bool) or not isinstance(n_public_groups, int) or n_public_groups < 1:
            raise ValueError(f"n_public_groups must be an integer >= 1. Found {n_public_groups!r}.")
        super().__init__(**common)
        self.k = k
        self.n_public_groups = n_public_groups

    def _aggregate_updates(
        self, round_index: int, silos: torch.Tensor, updates: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        public = public_mask(groups, n_public_groups=self.n_public_groups).to(updates.device)
        n_public = int(public.sum())
        full_rank = min(n_public, updates.shape[1])
        k = full_rank if self.k is None else min(self.k, full_rank)
        return pfa_aggregate(updates, public, k=k)
