"""The engine's one-silo DP-SGD gradient, read at a flat parameter vector.

An algorithm's silo half keeps its models as flat [P] vectors (so that clipping, averaging and
regularising are single tensor operations). A silo that runs it alone, a Flower ClientApp, takes its
steps here: the flat vector is copied into a private copy of the module and the gradient is the
engine's own `step.private_gradient` (ghost norms where a layer allows, one noise draw from the
silo's generator), the same function `DPSGDEngine.step` runs and `bench/dpsgd_throughput.py` times
against Opacus. So what a hospital runs is what is benchmarked; the simulator, which steps many silos
at once, runs the same phases batched (`batched`).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from dpledger.trainer.silo.dpsgd.capture import LossFn, trainable_parameters
from dpledger.trainer.silo.dpsgd.step import private_gradient


class FlatStep:
    """`private_gradient` of `module` at any flat parameter vector laid out as `module.parameters()`."""

    def __init__(self, module: nn.Module, loss_fn: LossFn) -> None:
        # A copy of its own: the steps write parameters into it, and the caller's module (a template
        # whose parameters are the run's initial model) must keep them.
        self.module = copy.deepcopy(module)
        self.loss_fn = loss_fn
        self.params = trainable_parameters(self.module)
        if len(self.params) != len(list(self.module.parameters())):
            raise ValueError("every parameter of the module must be trainable: the flat vector holds them all")
        self.size = sum(p.numel() for p in self.params)

    def gradient(self, flat: Tensor, x: Tensor, y: Tensor, *, max_grad_norm: float, noise_multiplier: float,
                 expected_batch_size: float, generator: torch.Generator) -> Tensor:
        """(Σ_i clip_C(g_i) + N(0, σ²C²)) / B at `flat` ([P]) on the batch (x, y), as a flat [P] vector."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat must be [{self.size}]-shaped. Found {tuple(flat.shape)}.")
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat, self.params)
        private = private_gradient(self.module, self.loss_fn, x, y, max_grad_norm=max_grad_norm,
                                   noise_multiplier=noise_multiplier, expected_batch_size=expected_batch_size,
                                   generator=generator)
        return torch.cat([g.reshape(-1) for g in private.grads])
