"""Federated data sets for the DP-SGD worker: one container type, several sources.

Every source returns a `FederatedDataset`: a tuple of per-silo `SiloData`, each with its own
train/test split, because in cross-silo FL each silo evaluates its own (possibly personalized)
model on its own local distribution (Liu et al. 2022 §3).

Sources (the research generators, the means of
"On Privacy and Personalization in Cross-Silo Federated Learning" §6 and the additive model of
"Personalization Improves Privacy-Accuracy Tradeoffs in Federated Learning" §6, live in the
repository's research/ folder):
- `make_rotated_masked_digits`: sklearn's 8×8 digits in the spirit of Liu et al. 2022 §5's rotated and
  masked MNIST.
- `load_npz_folder`: a user's own data, one `.npz` per silo.
- `draw_budgets`: per-silo ε from Liu et al. 2023 Table 1's MixGauss1–3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict, get_args

import torch

Task = Literal["classification", "regression", "mean"]
TASKS: tuple[str, ...] = get_args(Task)


class SiloTensors(TypedDict):
    """Every silo's train and test tensors, keyed as the federated algorithms' constructors take them."""

    x_train: list[torch.Tensor]
    y_train: list[torch.Tensor]
    x_test: list[torch.Tensor]
    y_test: list[torch.Tensor]


@dataclass(frozen=True)
class SiloData:
    """One silo's local data. The first dimension of every tensor indexes examples.

    `group` is the silo's ground-truth cluster where the source has one (the rotation group of the
    rotated digits, the `group` key of a user's file), else 0; it is for evaluating clustering and
    must never be sent to the coordinator.
    """

    silo_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    group: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"Silo {self.silo_id}: x_{split} and y_{split} must have the same number of examples. "
                    f"Found {x.shape[0]} and {y.shape[0]}."
                )
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"Silo {self.silo_id}: train and test examples must have the same shape. "
                f"Found {tuple(self.x_train.shape[1:])} and {tuple(self.x_test.shape[1:])}."
            )
        if self.x_train.shape[0] == 0:
            raise ValueError(f"Silo {self.silo_id}: x_train must hold at least one example. Found 0.")

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.x_test.shape[0])


@dataclass(frozen=True)
class FederatedDataset:
    """The silos of one federation plus what a model needs to know about them.

    `n_classes` is the number of labels for classification and None otherwise.
    """

    silos: tuple[SiloData, ...]
    task: Task
    n_features: int
    n_classes: int | None

    def __init__(
        self, silos: Sequence[SiloData], *, task: Task, n_features: int, n_classes: int | None
    ) -> None:
        # A hand-written __init__ so callers may pass a list; stored as a tuple to stay frozen.
        object.__setattr__(self, "silos", tuple(silos))
        object.__setattr__(self, "task", task)
        object.__setattr__(self, "n_features", n_features)
        object.__setattr__(self, "n_classes", n_classes)
        self._validate()

    def _validate(self) -> None:
        if not self.silos:
            raise ValueError("A federated dataset must hold at least one silo. Found 0.")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}. Found {self.task!r}.")
        if len(set(self.silo_ids)) != len(self.silo_ids):
            raise ValueError(f"Silo ids must be unique. Found {list(self.silo_ids)}.")
        if (self.task == "classification") != (self.n_classes is not None):
            raise ValueError(
                f"n_classes must be set exactly for classification. Found task={self.task!r}, "
                f"n_classes={self.n_classes}."
            )
        if self.n_classes is not None and self.n_classes < 2:
            raise ValueError(f"n_classes must be at least 2. Found {self.n_classes}.")
        for silo in self.silos:
            features = 1
            for size in silo.x_train.shape[1:]:
                features *= int(size)
            if features != self.n_features:
                raise ValueError(
                    f"Silo {silo.silo_id}: examples have {features} features, the dataset declares "
                    f"n_features={self.n_features}."
                )

    @property
    def silo_ids(self) -> tuple[int, ...]:
        return tuple(silo.silo_id for silo in self.silos)

    @property
    def n_silos(self) -> int:
        return len(self.silos)

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(silo.group for silo in self.silos)

    def tensors(self) -> SiloTensors:
        """Every silo's train and test tensors, keyed as the federated algorithms take them."""
        return {
            "x_train": [s.x_train for s in self.silos], "y_train": [s.y_train for s in self.silos],
            "x_test": [s.x_test for s in self.silos], "y_test": [s.y_test for s in self.silos],
        }

    def __len__(self) -> int:
        return len(self.silos)

    def __getitem__(self, index: int) -> SiloData:
        return self.silos[index]


# Imported after the containers because every source module builds them (import cycle otherwise).
from dpledger.trainer.data.budgets import (  # noqa: E402
    MIXGAUSS_TABLE,
    BudgetDraw,
    MixtureComponent,
    draw_budgets,
)
from dpledger.trainer.data.digits import make_rotated_masked_digits  # noqa: E402
from dpledger.trainer.data.npz import SiloFileError, load_npz_folder  # noqa: E402

__all__ = [
    "MIXGAUSS_TABLE",
    "TASKS",
    "BudgetDraw",
    "FederatedDataset",
    "MixtureComponent",
    "SiloData",
    "SiloFileError",
    "Task",
    "draw_budgets",
    "load_npz_folder",
    "make_rotated_masked_digits",
]
