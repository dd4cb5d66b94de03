"""Ditto (Li et al. 2021) under silo-specific sample-level DP, as benchmarked in Liu et al. 2022 §4."""

from __future__ import annotations

from typing import Unpack

import torch

from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import Weighting, check_lam, check_weighting


class Ditto(FederatedAlgorithm):
    """A global FedAvg model plus a personalized model v_k per silo.

    Each round, an approved silo first runs E_p = `personal_steps` DP-SGD steps on v_k with
    objective loss_k(v_k) + λ/2‖v_k − w‖² (w: the global model at the start of the round; Ditto
    Alg. 1 order), then E = `config.local_steps` DP-SGD steps on a copy of w; the server averages
    the copies. Both sets of steps query the silo's data with the same sampler and σ, so the round
    costs dpsgd(q_k, σ, E + E_p): this is Ditto's privacy overhead (Liu et al. 2022 §4, Fig. 4; §5,
    property (2)), and it must be charged, not hidden.
    """

    name = "ditto"
    cost = "dpsgd(B_k/n_k, σ, E + E_p)"
    deploys = "personalized model"

    def __init__(
        self,
        *,
        lam: float,
        personal_steps: int,
        weighting: Weighting = "uniform",
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        check_lam(lam)
        if personal_steps <= 0:
            raise ValueError(f"personal_steps must be positive. Found {personal_steps}.")
        self.weighting = check_weighting(weighting)
        super().__init__(**common)
        self.lam = lam
        self.personal_steps = personal_steps
        self.global_model = self.initial.clone()
        self.personal = self.initial.expand(self.num_silos, -1).clone()

    def declared_steps(self, round_index: int) -> list[int]:
        return [self.config.local_steps + self.personal_steps] * self.num_silos

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        anchor = self.global_model
        self.personal[silos] = self._dp_sgd(
            self.personal[silos], silos, steps=self.personal_steps, anchor=anchor, lam=self.lam
        )
        start = anchor.expand(len(silos), -1)
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps)
        self.global_model = self._aggregate(trained, silos, weighting=self.weighting)
        # The norm reported is that of the update shared with the server (the global-model copy);
        # the personalized model never leaves the silo.
        return update_norms(trained - start)

    def deployed_parameters(self) -> torch.Tensor:
        return self.personal

    def state(self) -> dict[str, torch.Tensor]:
        return {"global": self.global_model.clone(), "personal": self.personal.clone()}
