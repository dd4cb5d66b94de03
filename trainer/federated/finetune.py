"""Local finetuning: FedAvg, then local DP-SGD from the global model (Liu et al. 2022 §4, Fig. 2; refs
[99, 104, 19])."""

from __future__ import annotations

from typing import Unpack

from dpledger.trainer.federated.base import AlgorithmArgs
from dpledger.trainer.federated.config import Weighting
from dpledger.trainer.federated.fedavg import FedAvg
from dpledger.trainer.federated.warm_start import PersonalAfterWarmStart


class Finetuning(PersonalAfterWarmStart, FedAvg):
    """Rounds < `federated_rounds` are FedAvg; from then on each silo runs E DP-SGD steps per round
    on its own copy of the last global model and deploys it.

    Every round, federated or finetuning, queries the silo's data with E DP-SGD steps and is charged
    dpsgd(q_k, σ, E): the finetuning steps are not free, and Liu et al. 2022 Fig. 2 shows why the method
    disappoints under silo-specific DP (the noise averaging of FedAvg stops when finetuning starts).
    """

    name = "finetune"
    cost = "dpsgd(B_k/n_k, σ, E), finetuning rounds too"
    deploys = "global, then own model"

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
        self.federated_rounds = self.warm_start_rounds = federated_rounds
