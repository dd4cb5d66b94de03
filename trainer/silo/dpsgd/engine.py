"""The silo's DP-SGD engine: any `nn.Module` without cross-sample layers, on its own data, CPU or CUDA.

One step: ask the round's permit for a step (refused before any record is read when no reservation
covers it), draw a Poisson batch from the sampler that also declares the mechanism, clip each
example's gradient (ghost norms where the layer allows, `torch.func` otherwise:
`trainer.silo.dpsgd.norms`), add one Gaussian draw from an explicit generator, divide by the expected
batch size, step the optimizer. The permit comes from the round gate (`dpledger.trainer.silo.gate`); the
engine cannot step without one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils.data import Dataset, default_collate

from dpledger.trainer.silo.dpsgd.capture import LossFn, trainable_parameters
from dpledger.trainer.silo.dpsgd.noise import same_device
from dpledger.trainer.silo.dpsgd.sampler import PoissonSampler
from dpledger.trainer.silo.dpsgd.step import PrivateGradient, StepStats, dp_sgd_step, private_gradient


class StepPermit(Protocol):
    """What the engine asks before each step: the noise multiplier the reservation covers, or an
    exception when no reservation covers one more step at this sampling rate."""

    def take(self, *, noise_multiplier: float | None = None, sampling_rate: float | None = None) -> float: ...


def refuse_cross_sample_layers(model: nn.Module) -> None:
    """Refuse layers whose output for one example depends on the others of its batch (or whose
    buffers keep statistics of the data): per-sample gradients, and so DP-SGD, are undefined there."""
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            raise ValueError(
                f"Module {name!r} is a {type(module).__name__}: it mixes the examples of a batch, so per-sample "
                f"gradients and DP-SGD's guarantee are undefined. Replace it with nn.GroupNorm(groups, "
                f"{module.num_features}) (or LayerNorm)."
            )
        if isinstance(module, _InstanceNorm) and module.track_running_stats:
            raise ValueError(
                f"Module {name!r} tracks running statistics of the data outside DP-SGD's noise. "
                "Use track_running_stats=False, or GroupNorm."
            )


TensorPair = tuple[Tensor, Tensor]


class DPSGDEngine:
    """DP-SGD on a silo's own model and data.

    `data`: a pair of tensors (features, targets) indexed along their first dimension, or any
    map-style `Dataset` of (features, target) pairs, collated by torch's default collate.
    `loss_fn(output, y)` returns per-example losses (reduction="none").
    `generator` draws both the Poisson batches and the noise; it lives on the model's device.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn,
        data: TensorPair | Dataset[Any],
        batch_size: int,
        max_grad_norm: float,
        generator: torch.Generator,
        collate: Callable[[list[Any]], Any] = default_collate,
    ) -> None:
        refuse_cross_sample_layers(model)
        params = trainable_parameters(model)
        if not params:
            raise ValueError("The model has no trainable parameters.")
        self.device = params[0].device
        if not same_device(generator.device, self.device):
            raise ValueError(f"generator is on {generator.device} but the model is on {self.device}; create it there.")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.data, self.collate = data, collate
        self.max_grad_norm = float(max_grad_norm)
        self.generator = generator
        self.sampler = PoissonSampler(dataset_size=self._size(data), batch_size=batch_size, generator=generator)

    @staticmethod
    def _size(data: TensorPair | Dataset[Any]) -> int:
        if isinstance(data, tuple):
            x, y = data
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"features and targets must have as many rows. Found {x.shape[0]} and {y.shape[0]}.")
            return int(x.shape[0])
        return len(data)  # type: ignore[arg-type]  # map-style datasets define __len__; Dataset's stub does not

    def batch(self, indices: Tensor) -> TensorPair:
        """The records at `indices`, on the model's device (an empty pair for an empty batch)."""
        if indices.numel() == 0:
            empty = torch.empty(0, device=self.device)
            return empty, empty
        if isinstance(self.data, tuple):
            x, y = self.data
            rows = indices.to(x.device)
            return x[rows].to(self.device), y[rows].to(self.device)
        x, y = self.collate([self.data[i] for i in indices.tolist()])
        return x.to(self.device), y.to(self.device)

    @property
    def expected_batch_size(self) -> float:
        return float(self.sampler.batch_size)  # q·n with q = batch_size / n

    def private_gradient(self, x: Tensor, y: Tensor, *, noise_multiplier: float) -> PrivateGradient:
        """The step's gradient on a given batch without stepping: for checks against other engines."""
        return private_gradient(
            self.model, self.loss_fn, x, y, max_grad_norm=self.max_grad_norm, noise_multiplier=noise_multiplier,
            expected_batch_size=self.expected_batch_size, generator=self.generator,
        )

    def step(self, permit: StepPermit) -> StepStats:
        """One gated DP-SGD step. The permit is asked first, so a refused step reads no record."""
        sigma = permit.take(sampling_rate=self.sampler.sampling_rate)
        x, y = self.batch(self.sampler.sample())
        return dp_sgd_step(
            self.model, self.loss_fn, x, y, max_grad_norm=self.max_grad_norm, noise_multiplier=sigma,
            expected_batch_size=self.expected_batch_size, generator=self.generator, optimizer=self.optimizer,
        )
