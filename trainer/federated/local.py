"""Local training: each silo runs DP-SGD on its own model and never federates (paper 000 §3-4, one
end of the personalization spectrum)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.federated.base import FederatedAlgorithm
from trainer.federated.config import DPSGDConfig, Task
from trainer.federated.models import Architecture, ModelFactory


class LocalTraining(FederatedAlgorithm):
    """Each round, each approved silo runs E = `config.local_steps` DP-SGD steps on its own model.

    Declared cost per round: dpsgd(q_k = B_k/n_k, σ, E), the same as FedAvg's (paper 000 §3,
    consequence (1): local training and FedAvg have identical privacy costs).
    """

    name = "local"

    def __init__(
        self,
        *,
        x_train: Sequence[torch.Tensor],
        y_train: Sequence[torch.Tensor],
        x_test: Sequence[torch.Tensor],
        y_test: Sequence[torch.Tensor],
        model: ModelFactory | Architecture = "mlp",
        task: Task = "classification",
        num_classes: int | None = None,
        config: DPSGDConfig = DPSGDConfig(),
        noise_multipliers: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(
            x_train=x_train,
            y_train=y_train,
            x_test=x_test,
            y_test=y_test,
            model=model,
            task=task,
            num_classes=num_classes,
            config=config,
            noise_multipliers=noise_multipliers,
            device=device,
        )
        self.personal = self.initial.expand(self.num_silos, -1).clone()

    def declared_steps(self, round_index: int) -> list[int]:
        return [self.config.local_steps] * self.num_silos

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        start = self.personal[silos]
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps)
        self.personal[silos] = trained
        return torch.linalg.vector_norm(trained - start, dim=1)

    def deployed_parameters(self) -> torch.Tensor:
        return self.personal

    def state(self) -> dict[str, torch.Tensor]:
        return {"personal": self.personal.clone()}
