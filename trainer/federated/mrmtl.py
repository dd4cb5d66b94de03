"""Mean-regularized multi-task learning (MR-MTL), Liu et al. 2022 §5 and Appendix Alg. A1."""

from __future__ import annotations

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig, check_lam
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerHalf, ServerStart, Trained
from dpledger.trainer.federated.local import PERSONAL, PersonalSilo, train_personal

MEAN, MODEL = "mean", "model"


class PulledSilo(PersonalSilo):
    """Trains its own model pulled towards the received mean with weight λ; sends that model."""

    def __init__(self, config: DPSGDConfig, *, lam: float) -> None:
        super().__init__(config)
        self.lam = check_lam(lam)

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        norms = train_personal(engine, state, rows, steps=self.config.local_steps, anchor=received[MEAN], lam=self.lam)
        return Trained({MODEL: state[PERSONAL][rows]}, norms)


class MeanServer(ServerHalf):
    """w̄: the mean of every silo's latest personal model, a stopped silo's frozen one included
    (Liu et al. 2022 §5): each is already private, so averaging them is post-processing (§3)."""

    def __init__(self, start: ServerStart) -> None:
        super().__init__(start)
        self.latest = start.initial.expand(start.num_silos, -1).clone()
        self.mean = start.initial.clone()

    def broadcast(self, round_index: int) -> Arrays:
        return {MEAN: self.mean}

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        self.latest[members] = upload[MODEL]
        self.mean = self.latest.mean(0)

    def state(self) -> Arrays:
        return {MEAN: self.mean.clone()}


class MRMTL(FederatedAlgorithm):
    """Each silo keeps its own model w_k and minimises loss_k(w_k) + λ/2‖w_k − w̄‖², w̄ the mean of
    the personalized models after the previous round (Liu et al. 2022 §5: w_k ← w_k − η(g + λ(w_k − w̄))
    with g the noisy clipped gradient).

    Cost per round: dpsgd(q_k, σ, E), exactly local training's (Liu et al. 2022 §5, property (2): no
    extra dataset queries). λ = 0 is local training, bit for bit; larger λ federates more.
    """

    name = "mrmtl"
    cost = "dpsgd(B_k/n_k, σ, E)"
    deploys = "own model, pulled to the mean"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, lam: float) -> Halves:
        return Halves(PulledSilo(config, lam=lam), MeanServer)
