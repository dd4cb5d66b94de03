"""One silo's side of the training: its data file, the shared tiny CNN, and DP-SGD steps run on the
trainer's batched engine with one silo (the same sampler, clip and noise as the in-process
simulator, so the mechanism a silo declares is the sampler it runs)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpledger.trainer.dpsgd.sampler import PoissonSampler
from dpledger.trainer.federated.batched import noisy_clipped_gradient, pad_batches
from dpledger.trainer.federated.config import STREAM_INIT, derive_seed
from dpledger.trainer.federated.models import FlatModel, make_template

IMAGE_SIDE = 8
NUM_CLASSES = 10


def tiny_cnn() -> nn.Module:
    """A small CNN for 8×8 digits given as flat rows of 64: no BatchNorm (per-sample DP needs no
    buffers), tanh activations (bounded per-sample gradients suit clipping)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, IMAGE_SIDE, IMAGE_SIDE)),
        nn.Conv2d(1, 4, kernel_size=3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * (IMAGE_SIDE - 2) ** 2, NUM_CLASSES),
    )


def template(*, seed: int) -> FlatModel:
    """The run's model; its initial parameters are a function of the run's seed only."""
    return make_template(tiny_cnn, task="classification", in_features=IMAGE_SIDE**2, out_features=NUM_CLASSES,
                         init_seed=derive_seed(seed, STREAM_INIT), device=torch.device("cpu"))


@dataclass(frozen=True)
class SiloData:
    x: torch.Tensor  # [n, 64] float32
    y: torch.Tensor  # [n] int64
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.x.shape[0])


def load_silo_file(path: Path) -> SiloData:
    """An `.npz` with `x` (n, 64), `y` (n,) and `x_test`, `y_test`; loaded without pickle, so a data
    file can never run code."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read as a .npz archive of plain arrays ({error}).") from None
    for key in ("x", "y", "x_test", "y_test"):
        if key not in arrays:
            raise ValueError(f"{path}: missing key {key!r} (found {sorted(arrays)}).")
    for x_key, y_key in (("x", "y"), ("x_test", "y_test")):
        x, y = arrays[x_key], arrays[y_key]
        if x.ndim != 2 or x.shape[1] != IMAGE_SIDE**2 or y.shape != (x.shape[0],):
            raise ValueError(f"{path}: {x_key!r} must be (n, 64) and {y_key!r} (n,). Found {x.shape} and {y.shape}.")
        if not np.issubdtype(y.dtype, np.integer) or (y.size and (y.min() < 0 or y.max() >= NUM_CLASSES)):
            raise ValueError(f"{path}: {y_key!r} must hold integer labels in [0, {NUM_CLASSES}).")
    if arrays["x"].shape[0] == 0:
        raise ValueError(f"{path}: 'x' holds no records.")
    return SiloData(
        x=torch.as_tensor(arrays["x"], dtype=torch.float32), y=torch.as_tensor(arrays["y"], dtype=torch.int64),
        x_test=torch.as_tensor(arrays["x_test"], dtype=torch.float32),
        y_test=torch.as_tensor(arrays["y_test"], dtype=torch.int64),
    )


def round_mechanism(*, dataset_size: int, batch_size: int, noise_multiplier: float, steps: int) -> dict[str, Any]:
    """What one round of `steps` Poisson-sampled DP-SGD steps costs, as the sampler that runs it says."""
    sampler = PoissonSampler(dataset_size=dataset_size, batch_size=min(batch_size, dataset_size),
                             generator=torch.Generator())
    return sampler.mechanism(noise_multiplier=noise_multiplier, steps=steps)


def dp_sgd(
    model: FlatModel,
    data: SiloData,
    start: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    noise_multiplier: float,
    clip_norm: float,
    lr: float,
    anchor: torch.Tensor | None = None,
    lam: float = 0.0,
) -> torch.Tensor:
    """`steps` DP-SGD steps from `start` ([P]) on this silo's data; with an anchor, MR-MTL's
    λ/2‖w − anchor‖² is added after clipping and noise (post-processing, costs nothing).

    Batches and noise come from fresh OS randomness: the server must not be able to predict a
    silo's noise from anything it sent."""
    batch = min(batch_size, data.size)
    sampler = PoissonSampler(dataset_size=data.size, batch_size=batch,
                             generator=torch.Generator().manual_seed(secrets.randbits(63)))
    noise = [torch.Generator().manual_seed(secrets.randbits(63))]
    expected = torch.tensor([float(batch)])
    params = start.unsqueeze(0)
    for _ in range(steps):
        idx, mask = pad_batches([sampler.sample()], device=params.device)
        gradient = noisy_clipped_gradient(
            model, params, data.x[idx], data.y[idx], mask, clip_norm=clip_norm,
            noise_multipliers=noise_multiplier, expected_batch_sizes=expected, generators=noise,
        )
        if anchor is not None and lam != 0.0:
            gradient = gradient + lam * (params - anchor.unsqueeze(0))
        params = params - lr * gradient
    return params.squeeze(0).detach()


def accuracy(model: FlatModel, params: torch.Tensor, data: SiloData) -> float:
    if data.x_test.shape[0] == 0:
        return float("nan")
    with torch.no_grad():
        return float((model.forward(params, data.x_test).argmax(-1) == data.y_test).float().mean())
