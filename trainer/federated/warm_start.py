"""A personal phase after a warm start: the parent algorithm for the first rounds, then each silo
trains its own model from what it deployed at the switch (local finetuning, §4, and MR-MTL
warm-started by IFCA, §5, of "On Privacy and Personalization in Cross-Silo Federated Learning")."""

from __future__ import annotations

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm

# _PARENT: this class is only ever mixed in before a concrete algorithm, so its super() calls reach
# that algorithm's methods, never the abstract ones mypy sees on FederatedAlgorithm.


class PersonalAfterWarmStart(FederatedAlgorithm):
    """Mixed in before a concrete algorithm (`class X(PersonalAfterWarmStart, Parent)`): rounds
    < `warm_start_rounds` are the parent's; from then on each approved silo runs E DP-SGD steps on
    its own model, pulled towards `_personal_anchor` if that gives one. The round's mechanism stays
    the parent's `declared_steps` (E steps), so the personal steps are charged like any others."""

    warm_start_rounds: int
    personal: torch.Tensor | None = None

    def _personal_anchor(self, silos: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        """The model each of `silos` is pulled towards in the personal phase, and λ (none by default)."""
        return None, 0.0

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        if round_index < self.warm_start_rounds:
            return super()._train(round_index, silos)  # type: ignore[safe-super]  # see _PARENT
        if self.personal is None:
            # The switch: every silo starts from the model it deployed, refused ones included (that
            # model is already private, so copying it is free).
            self.personal = super().deployed_parameters().clone()  # type: ignore[safe-super]  # see _PARENT
        anchor, lam = self._personal_anchor(silos)
        return self._train_personal(self.personal, silos, anchor=anchor, lam=lam)

    def deployed_parameters(self) -> torch.Tensor:
        return super().deployed_parameters() if self.personal is None else self.personal  # type: ignore[safe-super]  # see _PARENT

    def state(self) -> dict[str, torch.Tensor]:
        state = super().state()  # type: ignore[safe-super]  # see _PARENT
        if self.personal is not None:
            state["personal"] = self.personal.clone()
        return state
