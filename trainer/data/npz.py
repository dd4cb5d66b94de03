"""A user's own federation: a folder holding one `.npz` file per silo.

Each file holds arrays `x` (n, ...) and `y` (n,) or (n, m); optionally `x_test` and `y_test`
(both or neither; otherwise a seeded split), and optionally a scalar integer `group` (the silo's
known cluster, for evaluating clustering only). Files are read in sorted name order; the i-th file
is silo i and its stem is the silo's name. Arrays are loaded with `allow_pickle=False`: a data file
must never be able to run code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpledger.trainer.data import FederatedDataset, SiloData, Task

REQUIRED_KEYS = ("x", "y")
OPTIONAL_KEYS = ("x_test", "y_test", "group")


class SiloFileError(ValueError):
    """A silo file is missing, unreadable, or inconsistent; the message names the file."""


def _arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
        raise SiloFileError(f"{path}: cannot read as a .npz archive of plain arrays ({error}).") from error


def _require(path: Path, arrays: dict[str, np.ndarray], key: str) -> np.ndarray:
    if key not in arrays:
        raise SiloFileError(
            f"{path}: missing key {key!r} (found keys: {sorted(arrays)}). Each silo file needs "
            f"{list(REQUIRED_KEYS)}, optionally {list(OPTIONAL_KEYS)}."
        )
    return arrays[key]


def _infer_task(y: np.ndarray) -> Task:
    return "classification" if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_ else "regression"


def _check_pair(path: Path, x: np.ndarray, y: np.ndarray, *, x_key: str, y_key: str) -> None:
    if x.ndim < 2:
        raise SiloFileError(f"{path}: {x_key!r} must have shape (n, features...). Found {x.shape}.")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise SiloFileError(
            f"{path}: {y_key!r} must have shape ({x.shape[0]},) or ({x.shape[0]}, m) to match {x_key!r}. "
            f"Found {y.shape}."
        )
    if not np.issubdtype(x.dtype, np.number):
        raise SiloFileError(f"{path}: {x_key!r} must be numeric. Found dtype {x.dtype}.")
    if not np.all(np.isfinite(x)):
        raise SiloFileError(f"{path}: {x_key!r} holds non-finite values.")


def _labels(path: Path, y: np.ndarray, *, key: str, task: Task) -> torch.Tensor:
    if task == "classification":
        if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_) or y.ndim != 1:
            raise SiloFileError(
                f"{path}: {key!r} must be a 1-D integer array for classification. Found {y.dtype} {y.shape}."
            )
        if y.size and y.min() < 0:
            raise SiloFileError(f"{path}: {key!r} labels must be >= 0. Found {int(y.min())}.")
        return torch.from_numpy(y.astype(np.int64))
    if not np.issubdtype(y.dtype, np.number) or not np.all(np.isfinite(y)):
        raise SiloFileError(f"{path}: {key!r} must be finite numbers for regression.")
    return torch.from_numpy(y.astype(np.float32))


def _train_test(
    path: Path, arrays: dict[str, np.ndarray], *, seed: int, silo_id: int, test_fraction: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The file's own test arrays if it has them, else a split seeded by (seed, silo index)."""
    x, y = arrays["x"], arrays["y"]
    has_x_test, has_y_test = "x_test" in arrays, "y_test" in arrays
    if has_x_test != has_y_test:
        missing = "y_test" if has_x_test else "x_test"
        raise SiloFileError(
            f"{path}: missing key {missing!r}; 'x_test' and 'y_test' go together (found keys: {sorted(arrays)})."
        )
    if has_x_test:
        x_test, y_test = arrays["x_test"], arrays["y_test"]
        _check_pair(path, x_test, y_test, x_key="x_test", y_key="y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise SiloFileError(
                f"{path}: 'x_test' examples have shape {tuple(x_test.shape[1:])}, 'x' has {tuple(x.shape[1:])}."
            )
        if x.shape[0] == 0:
            raise SiloFileError(f"{path}: 'x' must hold at least one training example. Found 0.")
        return x, y, x_test, y_test
    if x.shape[0] < 2:
        raise SiloFileError(f"{path}: needs at least 2 examples to split into train and test. Found {x.shape[0]}.")
    order = np.random.default_rng([seed, silo_id]).permutation(x.shape[0])
    n_test = min(x.shape[0] - 1, max(1, round(test_fraction * x.shape[0])))
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


def _group(path: Path, arrays: dict[str, np.ndarray]) -> int:
    if "group" not in arrays:
        return 0
    raw = arrays["group"]
    if raw.shape != () or not np.issubdtype(raw.dtype, np.integer):
        raise SiloFileError(f"{path}: 'group' must be a scalar integer. Found {raw.dtype} {raw.shape}.")
    return int(raw)


def load_npz_folder(
    folder: str | Path, *, seed: int, task: Task | None = None, test_fraction: float = 0.25
) -> FederatedDataset:
    """Load every `*.npz` in `folder` as one silo.

    `task` defaults to "classification" when the labels are integers and "regression" otherwise;
    it must agree across files. Without `x_test`/`y_test`, a silo's examples are split with a seeded
    permutation (seed and silo index together), keeping `test_fraction` of them (at least one) for test.

    Only the training split is sampled by DP-SGD, so a silo's ledger registration must give at most
    its number of training records as dataset_size (a file of n examples without test arrays trains
    on n − max(1, round(test_fraction · n))); `dpledger train` prints the number for each silo, and the
    worker stops before round 0 when the ledger's registered size is larger.
    """
    root = Path(folder)
    if not root.is_dir():
        raise SiloFileError(f"{root}: not a directory; expected a folder with one .npz file per silo.")
    paths = sorted(root.glob("*.npz"))
    if not paths:
        raise SiloFileError(f"{root}: no .npz files; expected one per silo.")
    if task not in (None, "classification", "regression"):
        raise ValueError(f"task must be 'classification', 'regression' or None. Found {task!r}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1). Found {test_fraction}.")

    first = _arrays(paths[0])
    y_first = _require(paths[0], first, "y")
    chosen: Task = _infer_task(y_first) if task is None else task
    feature_shape = tuple(_require(paths[0], first, "x").shape[1:])

    silos: list[SiloData] = []
    for silo_id, path in enumerate(paths):
        arrays = first if silo_id == 0 else _arrays(path)
        x = _require(path, arrays, "x")
        y = _require(path, arrays, "y")
        _check_pair(path, x, y, x_key="x", y_key="y")
        if task is None and _infer_task(y) != chosen:
            raise SiloFileError(
                f"{path}: labels look like {_infer_task(y)!r} but {paths[0]} gave {chosen!r}; pass task= explicitly."
            )
        if tuple(x.shape[1:]) != feature_shape:
            raise SiloFileError(
                f"{path}: examples have shape {tuple(x.shape[1:])}, earlier files have {feature_shape}."
            )
        x_train, y_train, x_test, y_test = _train_test(
            path, arrays, seed=seed, silo_id=silo_id, test_fraction=test_fraction
        )
        silos.append(
            SiloData(
                silo_id=silo_id,
                x_train=torch.from_numpy(np.asarray(x_train, dtype=np.float32)),
                y_train=_labels(path, y_train, key="y", task=chosen),
                x_test=torch.from_numpy(np.asarray(x_test, dtype=np.float32)),
                y_test=_labels(path, y_test, key="y_test", task=chosen),
                group=_group(path, arrays),
                name=path.stem,
            )
        )

    n_classes: int | None = None
    if chosen == "classification":
        # Labels index the classes, so the largest seen fixes the count (at least 2: a classifier).
        n_classes = max(2, 1 + max(int(torch.cat([s.y_train, s.y_test]).max()) for s in silos))
    return FederatedDataset(silos, task=chosen, n_features=int(np.prod(feature_shape)), n_classes=n_classes)
