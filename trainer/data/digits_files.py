"""Silo data files for trying a federation out: disjoint slices of scikit-learn's bundled 8×8 digits,
one `.npz` per silo, in the format a silo's Flower ClientApp reads (dpledger.flower.local.load_silo_file):
`x` (n, 64) float32 pixels in [0, 1], `y` (n,) int64 labels, and `x_test`, `y_test` likewise.

`dpledger data digits --silos 3 --train 400 --test 100 --out .` writes silo-1.npz … silo-3.npz.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

DIGITS_MAX_VALUE = 16.0  # load_digits() pixels are integers in [0, 16]


def write_digits_silo_files(folder: Path, *, silos: int, train: int, test: int, seed: int = 0, first: int = 1,
                            overwrite: bool = False) -> list[Path]:
    """Writes `silo-{first}.npz` … `silo-{first + silos - 1}.npz` in `folder`: silo k gets its own
    `train` + `test` images, drawn without replacement from one seeded permutation of the 1797
    digits (no image is in two silos). Refuses to replace an existing file unless `overwrite`."""
    digits = load_digits()
    available = len(digits.target)
    if silos < 1 or train < 1 or test < 0:
        raise ValueError(f"silos and train must be >= 1 and test >= 0. Found silos={silos}, train={train}, test={test}.")
    if silos * (train + test) > available:
        raise ValueError(f"the digits hold {available} images; {silos} silos × ({train} + {test}) need "
                         f"{silos * (train + test)}.")
    paths = [folder / f"silo-{first + k}.npz" for k in range(silos)]
    existing = [str(path) for path in paths if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass overwrite (--force) to replace it.")
    folder.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(seed).permutation(available)
    for k, path in enumerate(paths):
        rows = order[k * (train + test) : (k + 1) * (train + test)]
        x = (digits.data[rows] / DIGITS_MAX_VALUE).astype(np.float32)
        y = digits.target[rows].astype(np.int64)
        with path.open("wb") as out:  # a file object: np.savez would append ".npz" to a name without it
            np.savez(out, x=x[:train], y=y[:train], x_test=x[train:], y_test=y[train:])
    return paths
