"""The silos' shared architecture, seen as a function of one flat parameter vector.

Every silo holds the same architecture, so K silos' parameters stack into one [K, P] tensor and one
`vmap` trains them all. A flat vector (rather than a dict of tensors) makes clipping and noising a
single [.., P] operation and lets every algorithm store its state as plain [K, P] tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

import torch
from torch import nn
from torch.func import functional_call

from dpledger.trainer.federated.config import Task

Architecture = Literal["linear", "mlp"]
ModelFactory = Callable[[], nn.Module]


def build_model(architecture: Architecture, *, in_features: int, out_features: int, hidden: int = 32) -> nn.Module:
    """`linear`: logistic regression (classification) or linear regression (Bietti et al. 2022 §6's additive
    linear model); `mlp`: one hidden tanh layer (tanh rather than ReLU keeps per-sample gradients
    bounded and smooth, which suits clipping; Papernot et al. 2021, tempered sigmoids)."""
    if architecture == "linear":
        return nn.Linear(in_features, out_features)
    if architecture == "mlp":
        return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, out_features))
    raise ValueError(f"architecture must be 'linear' or 'mlp'. Found {architecture!r}.")


class FlatModel:
    """A module template evaluated at any flat parameter vector through `functional_call`."""

    def __init__(self, module: nn.Module, *, task: Task) -> None:
        if any(True for _ in module.buffers()):
            # Buffers such as BatchNorm statistics mix examples within a batch, which breaks both
            # per-sample gradients and the per-sample sensitivity that DP-SGD's accounting assumes.
            raise ValueError("The model must have no buffers (e.g. no BatchNorm); per-sample DP needs that.")
        self.module = module
        self.task: Task = task
        named = [(name, p) for name, p in module.named_parameters()]
        if not named:
            raise ValueError("The model has no parameters.")
        self.names = [name for name, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.size = sum(self.numels)

    def initial(self) -> torch.Tensor:
        """The template's own parameters, flattened ([P])."""
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        chunks = torch.split(flat, self.numels)
        return {name: chunk.view(shape) for name, chunk, shape in zip(self.names, chunks, self.shapes, strict=True)}

    def forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Outputs of the model with parameters `flat` ([P]) on a batch `x` ([b, d])."""
        return cast(torch.Tensor, functional_call(self.module, self.unflatten(flat), (x,)))

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss over a batch: cross-entropy, or half squared error (Bietti et al. 2022 §6, squared loss)."""
        if self.task == "classification":
            return nn.functional.cross_entropy(out, y)
        return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()

    def per_example_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`loss` of each example of a batch ([b]): what the engine's one-silo step differentiates."""
        if self.task == "classification":
            return nn.functional.cross_entropy(out, y, reduction="none")
        return 0.5 * (out.squeeze(-1) - y) ** 2

    def example_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Loss of one example (x: [d], y: scalar); the function `vmap(grad(...))` differentiates."""
        return self.loss(self.forward(flat, x.unsqueeze(0)), y.unsqueeze(0))


def make_template(
    model: ModelFactory | Architecture,
    *,
    task: Task,
    in_features: int,
    out_features: int,
    init_seed: int,
    device: torch.device,
) -> FlatModel:
    """Build the template under a private CPU RNG seeded from the run's seed, so the initial model
    is the same on CPU and CUDA and the global RNG of the caller is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        module = model() if callable(model) else build_model(model, in_features=in_features, out_features=out_features)
    return FlatModel(module.to(device), task=task)
