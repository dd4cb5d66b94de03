"""FedAvg under silo-specific sample-level DP: local DP-SGD from the global model, server average
(Liu et al. 2022 §2-4; McMahan et al. 2017)."""

from __future__ import annotations

from typing import Unpack

import torch

from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import Weighting, check_weighting


class FedAvg(FederatedAlgorithm):
    """Each round, each approved silo copies the global model, runs E DP-SGD steps, and the server
    averages the approved silos' results (uniformly by default; see `Weighting`).

    Cost per round: dpsgd(q_k, σ, E), identical to local training (Liu et al. 2022 §3). Each silo deploys
    the global model; averaging already-private updates is post-processing, so the global model may
    keep improving from other silos after a silo's budget is spent at no cost to that silo.
    """

    name = "fedavg"
    cost = "dpsgd(B_k/n_k, σ, E)"
    deploys = "global model"

    def __init__(
        self,
        *,
        weighting: Weighting = "uniform",
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        self.weighting = check_weighting(weighting)
        super().__init__(**common)
        self.global_model = self.initial.clone()
        # The model each silo last trained locally (what it uploaded); refused silos keep theirs.
        self.local = self.initial.expand(self.num_silos, -1).clone()

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        start = self.global_model.expand(len(silos), -1)
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps)
        self.local[silos] = trained
        self.global_model = self._aggregate(trained, silos, weighting=self.weighting)
        return update_norms(trained - start)

    def deployed_parameters(self) -> torch.Tensor:
        return self.global_model.expand(self.num_silos, -1)

    def state(self) -> dict[str, torch.Tensor]:
        return {"global": self.global_model.clone(), "local": self.local.clone()}
