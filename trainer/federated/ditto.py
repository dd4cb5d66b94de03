"""Ditto (Li et al. 2021) under silo-specific sample-level DP, as benchmarked in Liu et al. 2022 §4."""

from __future__ import annotations

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig, Weighting, check_lam, check_weighting
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.fedavg import GLOBAL, AveragingServer, GlobalModelSilo
from dpledger.trainer.federated.halves import Arrays, Halves, Trained
from dpledger.trainer.federated.local import PERSONAL


class DittoSilo(GlobalModelSilo):
    """First E_p DP-SGD steps on the personal model v_k towards the received global w (Ditto Alg. 1
    order), then E steps on a copy of w, which it sends. The reported norm is that of the update
    shared with the server; the personalized model never leaves the silo."""

    def __init__(self, config: DPSGDConfig, *, lam: float, personal_steps: int, weighting: Weighting) -> None:
        super().__init__(config, weighting=weighting)
        self.lam = check_lam(lam)
        if personal_steps <= 0:
            raise ValueError(f"personal_steps must be positive. Found {personal_steps}.")
        self.personal_steps = personal_steps

    def steps(self, round_index: int) -> int:
        return self.config.local_steps + self.personal_steps

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        return {**super().start(initial, rows), PERSONAL: initial.expand(rows, -1).clone()}

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        state[PERSONAL][rows] = engine.dp_sgd(state[PERSONAL][rows], rows, steps=self.personal_steps,
                                              anchor=received[GLOBAL], lam=self.lam)
        return self.train_global(engine, rows, received, state)

    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        return state[PERSONAL]


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

    @classmethod
    def halves(cls, config: DPSGDConfig, *, lam: float, personal_steps: int, weighting: Weighting = "uniform") -> Halves:
        chosen = check_weighting(weighting)
        return Halves(DittoSilo(config, lam=lam, personal_steps=personal_steps, weighting=chosen),
                      lambda start: AveragingServer(start, weighting=chosen))
