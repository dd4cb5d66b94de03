"""Local training: each silo runs DP-SGD on its own model and never federates (Liu et al. 2022 §3-4, one
end of the personalization spectrum); and the personal-model silo half that MR-MTL, Ditto and the
warm-started algorithms build on."""

from __future__ import annotations

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerHalf, SiloHalf, Trained
from dpledger.trainer.federated.plan import STEPS

PERSONAL = "personal"


def train_personal(engine: SiloEngine, state: Arrays, rows: torch.Tensor, *, steps: int,
                   anchor: torch.Tensor | None = None, lam: float = 0.0, noised: bool = True,
                   kind: str = STEPS) -> torch.Tensor:
    """`steps` DP-SGD steps on each row's own model (state["personal"], updated in place), pulled
    towards `anchor` ([A, P] or [P]) with weight λ if given; returns the update norms."""
    start = state[PERSONAL][rows]
    trained = engine.dp_sgd(start, rows, steps=steps, anchor=anchor, lam=lam, noised=noised, kind=kind)
    state[PERSONAL][rows] = trained
    return update_norms(trained - start)


class PersonalSilo(SiloHalf):
    """Each silo trains its own model and sends nothing."""

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        return {PERSONAL: initial.expand(rows, -1).clone()}

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        return Trained({}, train_personal(engine, state, rows, steps=self.config.local_steps))

    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        return state[PERSONAL]


class SilentServer(ServerHalf):
    """A server that sends and keeps nothing."""

    def broadcast(self, round_index: int) -> Arrays:
        return {}

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        pass

    def state(self) -> Arrays:
        return {}


class LocalTraining(FederatedAlgorithm):
    """Each round, each approved silo runs E = `config.local_steps` DP-SGD steps on its own model.

    Declared cost per round: dpsgd(q_k = B_k/n_k, σ, E), the same as FedAvg's (Liu et al. 2022 §3,
    consequence (1): local training and FedAvg have identical privacy costs).
    """

    name = "local"
    cost = "dpsgd(B_k/n_k, σ, E)"
    deploys = "own model"

    @classmethod
    def halves(cls, config: DPSGDConfig) -> Halves:
        return Halves(PersonalSilo(config), SilentServer)
