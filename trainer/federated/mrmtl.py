"""Mean-regularized multi-task learning (MR-MTL), Liu et al. 2022 §5 and Appendix Alg. A1."""

from __future__ import annotations

from typing import Unpack

import torch

from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm
from dpledger.trainer.federated.config import check_lam


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

    def __init__(
        self,
        *,
        lam: float,
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        self.lam = check_lam(lam)
        super().__init__(**common)
        self.personal = self.initial.expand(self.num_silos, -1).clone()
        self.mean = self.initial.clone()

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        norms = self._train_personal(self.personal, silos, anchor=self.mean, lam=self.lam)
        # w̄ is the mean of *all* personalized models (Liu et al. 2022 §5), a refused silo's frozen one
        # included: each is already private, so averaging them is post-processing (§3).
        self.mean = self.personal.mean(0)
        return norms

    def deployed_parameters(self) -> torch.Tensor:
        return self.personal

    def state(self) -> dict[str, torch.Tensor]:
        return {"personal": self.personal.clone(), "mean": self.mean.clone()}
