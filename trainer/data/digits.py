"""scikit-learn's bundled 8×8 digits, split into K silos with two layers of heterogeneity, after
Liu et al. 2022 §5 ("MR-MTL under structured heterogeneity"; Fig. 6, rotated & masked MNIST).

Layer 1, 4-way rotation: each silo belongs to one of four groups that rotates all its images by
0°, 90°, 180° or 270° (paper: 4 groups of 10 silos); this creates 4 well-defined clusters.
Layer 2, silo-specific masking: each silo draws its own fixed random mask of square patches, each
patch masked with probability p, and applies it to every one of its images (train and test); this
adds intra-cluster heterogeneity that grows with p.

Two adaptations to 8×8 images, both knobs: the paper masks 2×2 patches of 28×28 MNIST; a 2×2
MNIST patch is under one pixel at 8×8, so the default patch is 1×1. The paper's patches are
"white"; masked pixels here get `mask_fill` (default 0.0, i.e. erased ink; 1.0 gives the paper's
white patches on a [0, 1] scale).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from sklearn.datasets import load_digits

from dpledger.trainer.data import FederatedDataset, SiloData

N_ROTATION_GROUPS = 4
IMAGE_SIDE = 8
DIGITS_MAX_VALUE = 16.0  # load_digits() pixels are integers in [0, 16]
GroupAssignment = Literal["round_robin", "random"]
# Dirichlet label skew may leave a silo too small for a train/test split; redraws are bounded so a
# hopeless configuration fails with a clear error instead of looping.
MAX_PARTITION_ATTEMPTS = 1000


def _iid_partition(rng: np.random.Generator, *, n_examples: int, n_silos: int) -> list[np.ndarray]:
    return [np.sort(part) for part in np.array_split(rng.permutation(n_examples), n_silos)]


def _dirichlet_partition(
    rng: np.random.Generator, *, labels: np.ndarray, n_silos: int, alpha: float, min_size: int
) -> list[np.ndarray]:
    """Label skew: for each class, the share of its examples that each silo receives is drawn from
    Dir(α·1_K) (the usual NIID recipe; small α gives each silo few classes)."""
    classes = np.unique(labels)
    for _ in range(MAX_PARTITION_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_silos)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(n_silos, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for silo, chunk in enumerate(np.split(members, cuts)):
                parts[silo].append(chunk)
        merged = [np.sort(np.concatenate(chunks)) for chunks in parts]
        if min(len(part) for part in merged) >= min_size:
            return merged
    raise ValueError(
        f"Could not give every one of {n_silos} silos at least {min_size} examples with label skew "
        f"alpha={alpha} in {MAX_PARTITION_ATTEMPTS} draws; use fewer silos or a larger alpha."
    )


def _silo_mask(rng: np.random.Generator, *, probability: float, patch_size: int) -> np.ndarray:
    """A boolean (8, 8) mask made of patch_size×patch_size patches, each on with the given probability.

    The uniforms are drawn whatever the probability, so the same seed gives nested masks as p grows
    and the partition and split do not depend on p (masking is then the only thing p changes).
    """
    cells = IMAGE_SIDE // patch_size
    uniforms = rng.random((cells, cells))
    return np.kron(uniforms < probability, np.ones((patch_size, patch_size), dtype=bool))


def make_rotated_masked_digits(
    *,
    n_silos: int,
    seed: int,
    mask_probability: float = 0.0,
    patch_size: int = 1,
    mask_fill: float = 0.0,
    group_assignment: GroupAssignment = "round_robin",
    label_skew_alpha: float | None = None,
    test_fraction: float = 0.25,
    flatten: bool = True,
) -> FederatedDataset:
    """The digits split into `n_silos` disjoint silos, each rotated by its group and masked by its mask.

    Silo k's rotation group is k mod 4 ("round_robin") or a seeded shuffle of those same balanced
    labels ("random"); group g rotates by g·90° counter-clockwise (`np.rot90(image, k=g)`).
    Pixels are scaled to [0, 1]. x: (n, 64) float32 if `flatten`, else (n, 1, 8, 8); y: (n,) int64.
    Deterministic from `seed`.
    """
    if n_silos < 1:
        raise ValueError(f"n_silos must be at least 1. Found {n_silos}.")
    if not 0.0 <= mask_probability <= 1.0:
        raise ValueError(f"mask_probability must be in [0, 1]. Found {mask_probability}.")
    if patch_size < 1 or IMAGE_SIDE % patch_size != 0:
        raise ValueError(f"patch_size must divide {IMAGE_SIDE}. Found {patch_size}.")
    if not 0.0 <= mask_fill <= 1.0:
        raise ValueError(f"mask_fill must be in [0, 1] (pixels are scaled to [0, 1]). Found {mask_fill}.")
    if group_assignment not in ("round_robin", "random"):
        raise ValueError(f"group_assignment must be 'round_robin' or 'random'. Found {group_assignment!r}.")
    if label_skew_alpha is not None and not label_skew_alpha > 0.0:
        raise ValueError(f"label_skew_alpha must be > 0. Found {label_skew_alpha}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1). Found {test_fraction}.")

    digits = load_digits()
    images = np.asarray(digits.images, dtype=np.float64) / DIGITS_MAX_VALUE
    labels = np.asarray(digits.target, dtype=np.int64)
    if n_silos * 2 > len(labels):
        raise ValueError(f"n_silos must be at most {len(labels) // 2} (two examples per silo). Found {n_silos}.")

    # Independent streams per concern, so a knob of one (e.g. p) never shifts the draws of another.
    partition_rng, group_rng, mask_rng, split_rng = (
        np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(4)
    )
    if label_skew_alpha is None:
        parts = _iid_partition(partition_rng, n_examples=len(labels), n_silos=n_silos)
    else:
        parts = _dirichlet_partition(partition_rng, labels=labels, n_silos=n_silos, alpha=label_skew_alpha, min_size=2)
    groups = np.arange(n_silos) % N_ROTATION_GROUPS
    if group_assignment == "random":
        groups = group_rng.permutation(groups)

    silos = []
    for silo_id, indices in enumerate(parts):
        group = int(groups[silo_id])
        # Liu et al. 2022 §5, layer 1: the whole silo is rotated by its group's angle.
        silo_images = np.rot90(images[indices], k=group, axes=(1, 2))
        # Liu et al. 2022 §5, layer 2: one fixed mask per silo, the same pixels for every image.
        mask = _silo_mask(mask_rng, probability=mask_probability, patch_size=patch_size)
        silo_images = np.where(mask[None, :, :], mask_fill, silo_images)
        order = split_rng.permutation(len(indices))
        n_test = min(len(indices) - 1, max(1, round(test_fraction * len(indices))))
        test_idx, train_idx = order[:n_test], order[n_test:]
        shape = (-1, IMAGE_SIDE * IMAGE_SIDE) if flatten else (-1, 1, IMAGE_SIDE, IMAGE_SIDE)
        x = torch.from_numpy(np.ascontiguousarray(silo_images, dtype=np.float32).reshape(shape))
        y = torch.from_numpy(labels[indices])
        silos.append(
            SiloData(
                silo_id=silo_id,
                x_train=x[train_idx],
                y_train=y[train_idx],
                x_test=x[test_idx],
                y_test=y[test_idx],
                group=group,
                name=f"digits-silo-{silo_id}",
            )
        )
    return FederatedDataset(silos, task="classification", n_features=IMAGE_SIDE * IMAGE_SIDE, n_classes=10)
