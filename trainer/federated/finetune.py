"""Local finetuning: FedAvg, then local DP-SGD from the global model (Liu et al. 2022 §4, Fig. 2; refs
[99, 104, 19])."""

from __future__ import annotations

from dpledger.trainer.federated.base import FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig, Weighting, check_weighting
from dpledger.trainer.federated.fedavg import AveragingServer, GlobalModelSilo
from dpledger.trainer.federated.halves import Halves
from dpledger.trainer.federated.warm_start import PersonalAfterWarmStart


class Finetuning(FederatedAlgorithm):
    """Rounds < `federated_rounds` are FedAvg; from then on each silo runs E DP-SGD steps per round
    on its own copy of the last global model and deploys it.

    Every round, federated or finetuning, queries the silo's data with E DP-SGD steps and is charged
    dpsgd(q_k, σ, E): the finetuning steps are not free, and Liu et al. 2022 Fig. 2 shows why the method
    disappoints under silo-specific DP (the noise averaging of FedAvg stops when finetuning starts).
    """

    name = "finetune"
    cost = "dpsgd(B_k/n_k, σ, E), finetuning rounds too"
    deploys = "global, then own model"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, federated_rounds: int, weighting: Weighting = "uniform") -> Halves:
        if federated_rounds < 0:
            raise ValueError(f"federated_rounds must be >= 0. Found {federated_rounds}.")
        chosen = check_weighting(weighting)
        silo = PersonalAfterWarmStart(GlobalModelSilo(config, weighting=chosen), warm_start_rounds=federated_rounds)
        return Halves(silo, lambda start: AveragingServer(start, weighting=chosen))
