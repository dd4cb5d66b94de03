"""One silo's data file and the shared tiny CNN; its training is the run's silo half over its own
`SiloEngine` (dpledger.flower.family)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

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


def accuracy(model: FlatModel, params: torch.Tensor, data: SiloData) -> float:
    if data.x_test.shape[0] == 0:
        return float("nan")
    with torch.no_grad():
        return float((model.forward(params, data.x_test).argmax(-1) == data.y_test).float().mean())
