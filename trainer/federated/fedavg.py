"""FedAvg under silo-specific sample-level DP: local DP-SGD from the global model, server average
(Liu et al. 2022 §2-4; McMahan et al. 2017)."""

from __future__ import annotations

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import DPSGDConfig, Weighting, check_weighting
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerHalf, ServerStart, SiloHalf, Trained

GLOBAL, MODEL, SIZE = "global", "model", "size"


class GlobalModelSilo(SiloHalf):
    """Trains a copy of the received global model with E DP-SGD steps and sends it back (with its
    registered record count when the server weighs by dataset size: public, the ledger holds it)."""

    def __init__(self, config: DPSGDConfig, *, weighting: Weighting = "uniform") -> None:
        super().__init__(config)
        self.weighting = weighting

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        # The model each silo last trained (what it uploaded); a refused silo keeps its last one.
        return {"local": initial.expand(rows, -1).clone()}

    def train_global(self, engine: SiloEngine, rows: torch.Tensor, received: Arrays, state: Arrays) -> Trained:
        start = received[GLOBAL].expand(len(rows), -1)
        trained = engine.dp_sgd(start, rows, steps=self.config.local_steps)
        state["local"][rows] = trained
        upload = {MODEL: trained}
        if self.weighting == "dataset_size":
            upload[SIZE] = torch.tensor(engine.train.sizes, dtype=trained.dtype, device=trained.device)[rows]
        return Trained(upload, update_norms(trained - start))

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        return self.train_global(engine, rows, received, state)

    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        return received[GLOBAL].expand(state["local"].shape[0], -1)


class AveragingServer(ServerHalf):
    """Keeps the global model; averages the trained copies it receives (uniformly, or weighted by the
    silos' record counts; Liu et al. 2022 §2). Averaging already-private models is post-processing."""

    def __init__(self, start: ServerStart, *, weighting: Weighting = "uniform") -> None:
        super().__init__(start)
        self.weighting = weighting
        self.global_model = start.initial.clone()

    def broadcast(self, round_index: int) -> Arrays:
        return {GLOBAL: self.global_model}

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        if MODEL not in upload:
            return  # a round whose silos sent nothing to average (finetuning's personal rounds)
        models = upload[MODEL]
        if self.weighting == "uniform":
            self.global_model = models.mean(0)
        else:
            sizes = upload[SIZE]
            self.global_model = (models * (sizes / sizes.sum()).unsqueeze(1)).sum(0)

    def state(self) -> Arrays:
        return {GLOBAL: self.global_model.clone()}


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

    @classmethod
    def halves(cls, config: DPSGDConfig, *, weighting: Weighting = "uniform") -> Halves:
        chosen = check_weighting(weighting)
        return Halves(GlobalModelSilo(config, weighting=chosen), lambda start: AveragingServer(start, weighting=chosen))
