"""Local training: each silo runs DP-SGD on its own model and never federates (Liu et al. 2022 §3-4, one
end of the personalization spectrum)."""

from __future__ import annotations

from typing import Unpack

import torch

from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm


class LocalTraining(FederatedAlgorithm):
    """Each round, each approved silo runs E = `config.local_steps` DP-SGD steps on its own model.

    Declared cost per round: dpsgd(q_k = B_k/n_k, σ, E), the same as FedAvg's (Liu et al. 2022 §3,
    consequence (1): local training and FedAvg have identical privacy costs).
    """

    name = "local"
    cost = "dpsgd(B_k/n_k, σ, E)"
    deploys = "own model"

    def __init__(self, **common: Unpack[AlgorithmArgs]) -> None:
        super().__init__(**common)
        self.personal = self.initial.expand(self.num_silos, -1).clone()

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        return self._train_personal(self.personal, silos)

    def deployed_parameters(self) -> torch.Tensor:
        return self.personal

    def state(self) -> dict[str, torch.Tensor]:
        return {"personal": self.personal.clone()}
