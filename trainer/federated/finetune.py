"""Local finetuning: FedAvg, then local DP-SGD from the global model (paper 000 §4, Fig. 2; refs
[99, 104, 19])."""

from __future__ import annotations

from typing import Unpack

import torch

from dpledger.trainer.federated.base import AlgorithmArgs, update_norms
from dpledger.trainer.federated.config import Weighting
from dpledger.trainer.federated.fedavg import FedAvg


class Finetuning(FedAvg):
    """Rounds < `federated_rounds` are FedAvg; from then on each silo runs E DP-SGD steps per round
    on its own copy of the last global model and deploys it.

    Every round, federated or finetuning, queries the silo's data with E DP-SGD steps and is charged
    dpsgd(q_k, σ, E): the finetuning steps are not free, and paper 000 Fig. 2 shows why the method
    disappoints under silo-specific DP (the noise averaging of FedAvg stops when finetuning starts).
    """

    name = "finetune"

    def __init__(
        self,
        *,
        federated_rounds: int,
        weighting: Weighting = "uniform",
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        if federated_rounds < 0:
            raise ValueError(f"federated_rounds must be >= 0. Found {federated_rounds}.")
        super().__init__(weighting=weighting, **common)
        self.federated_rounds = federated_rounds
        self.personal: torch.Tensor | None = None

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        if round_index < self.federated_rounds:
            return super()._train(round_index, silos)
        if self.personal is None:
            self.personal = self.global_model.expand(self.num_silos, -1).clone()
        start = self.personal[silos]
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps)
        self.personal[silos] = trained
        return update_norms(trained - start)

    def deployed_parameters(self) -> torch.Tensor:
        return super().deployed_parameters() if self.personal is None else self.personal

    def state(self) -> dict[str, torch.Tensor]:
        state = super().state()
        if self.personal is not None:
            state["personal"] = self.personal.clone()
        return state
