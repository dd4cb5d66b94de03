"""A personal phase after a warm start: the parent algorithm's silo half for the first rounds, then
each silo trains its own model from what it deployed at the switch (local finetuning, §4, and MR-MTL
warm-started by IFCA, §5, of "On Privacy and Personalization in Cross-Silo Federated Learning")."""

from __future__ import annotations

import torch

from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, SiloHalf, Trained
from dpledger.trainer.federated.local import PERSONAL, train_personal
from dpledger.trainer.federated.plan import PlannedQuery

SWITCHED = "switched"


class PersonalAfterWarmStart(SiloHalf):
    """Rounds < `warm_start_rounds` are `parent`'s; from then on each approved silo runs E DP-SGD
    steps on its own model, which starts as the model it deployed (already private, so copying it is
    free), pulled towards `anchor` if a subclass gives one. The round's queries stay the parent's
    (its E steps, its extra queries), so the personal steps are charged like any others."""

    def __init__(self, parent: SiloHalf, *, warm_start_rounds: int) -> None:
        super().__init__(parent.config)
        self.parent = parent
        self.warm_start_rounds = warm_start_rounds

    def steps(self, round_index: int) -> int:
        return self.parent.steps(round_index)

    def extra_queries(self, round_index: int, engine: SiloEngine, row: int) -> tuple[PlannedQuery, ...]:
        return self.parent.extra_queries(round_index, engine, row)

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        return {**self.parent.start(initial, rows), PERSONAL: initial.expand(rows, -1).clone(),
                SWITCHED: torch.zeros(rows, dtype=torch.bool, device=initial.device)}

    def anchor(self, received: Arrays, state: Arrays, rows: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        """The model each of `rows` is pulled towards in the personal phase, and λ (none by default)."""
        return None, 0.0

    def personal_upload(self, state: Arrays, rows: torch.Tensor) -> Arrays:
        """What a silo sends in the personal phase (nothing by default)."""
        return {}

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        if round_index < self.warm_start_rounds:
            return self.parent.train(round_index, engine, rows, received, state)
        new = rows[~state[SWITCHED][rows]]
        if len(new):
            state[PERSONAL][new] = self.parent.deployed(received, state)[new]
            state[SWITCHED][new] = True
        anchor, lam = self.anchor(received, state, rows)
        norms = train_personal(engine, state, rows, steps=self.steps(round_index), anchor=anchor, lam=lam)
        return Trained(self.personal_upload(state, rows), norms)

    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        return torch.where(state[SWITCHED].unsqueeze(1), state[PERSONAL], self.parent.deployed(received, state))
