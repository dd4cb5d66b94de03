"""The federated data sources: containers, rotated & masked digits (Liu et al. 2022 §5), user .npz
folders, and Liu et al. 2023 Table 1 budgets. The research generators are tested in
tests/research/test_datasets.py."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dpledger.trainer.data import (
    MIXGAUSS_TABLE,
    FederatedDataset,
    SiloData,
    SiloFileError,
    draw_budgets,
    load_npz_folder,
    make_rotated_masked_digits,
)
from dpledger.trainer.data.budgets import MixtureName

# Two-sided 5 standard errors: a correct generator fails one such check ~6e-7 of the time.
Z = 5.0


def assert_same_dataset(a: FederatedDataset, b: FederatedDataset) -> None:
    assert (a.task, a.n_features, a.n_classes, a.groups) == (b.task, b.n_features, b.n_classes, b.groups)
    for silo_a, silo_b in zip(a.silos, b.silos, strict=True):
        for name in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(silo_a, name), getattr(silo_b, name)), (silo_a.silo_id, name)


def original_digits() -> np.ndarray:
    return (load_digits().images / 16.0).astype(np.float32)


# --- containers ---------------------------------------------------------------------------------


def test_containers_validate_shapes_and_ids() -> None:
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)
    silo = SiloData(silo_id=0, x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])
    with pytest.raises(ValueError, match=re.escape("x_train and y_train must have the same number of examples. Found 4 and 3")):
        SiloData(silo_id=1, x_train=x, y_train=y[:3], x_test=x, y_test=y)
    with pytest.raises(ValueError, match="Silo ids must be unique"):
        FederatedDataset([silo, silo], task="classification", n_features=3, n_classes=2)
    with pytest.raises(ValueError, match="declares n_features=5"):
        FederatedDataset([silo], task="classification", n_features=5, n_classes=2)
    with pytest.raises(ValueError, match="n_classes must be set exactly for classification"):
        FederatedDataset([silo], task="regression", n_features=3, n_classes=2)
    dataset = FederatedDataset([silo], task="classification", n_features=3, n_classes=2)
    assert dataset.silos == (silo,) and dataset[0] is silo and len(dataset) == 1


# --- rotated & masked digits (Liu et al. 2022 §5) -----------------------------------------------------


def test_digits_shapes_partition_and_determinism() -> None:
    dataset = make_rotated_masked_digits(n_silos=40, seed=0)
    assert dataset.task == "classification" and dataset.n_classes == 10 and dataset.n_features == 64
    assert sum(s.n_train + s.n_test for s in dataset.silos) == 1797  # disjoint silos cover the data set
    assert dataset.groups == tuple(k % 4 for k in range(40))
    for silo in dataset.silos:
        assert silo.x_train.shape[1:] == (64,) and silo.x_train.dtype == torch.float32
        assert silo.y_train.dtype == torch.int64 and silo.n_test >= 1
        assert 0.0 <= float(silo.x_train.min()) and float(silo.x_train.max()) <= 1.0
        assert silo.n_test == round(0.25 * (silo.n_train + silo.n_test))
    assert float(max(s.x_train.max() for s in dataset.silos)) == 1.0  # scaled by 16, not by a silo max
    assert_same_dataset(dataset, make_rotated_masked_digits(n_silos=40, seed=0))
    other = make_rotated_masked_digits(n_silos=40, seed=1)
    assert not torch.equal(dataset[0].y_train, other[0].y_train)

    image_shaped = make_rotated_masked_digits(n_silos=40, seed=0, flatten=False)
    assert image_shaped[0].x_train.shape[1:] == (1, 8, 8)
    assert torch.equal(image_shaped[0].x_train.reshape(-1, 64), dataset[0].x_train)


def test_digits_random_group_assignment_is_balanced_and_seeded() -> None:
    a = make_rotated_masked_digits(n_silos=20, seed=5, group_assignment="random")
    assert sorted(a.groups) == sorted(k % 4 for k in range(20))
    assert a.groups != tuple(k % 4 for k in range(20))
    assert a.groups == make_rotated_masked_digits(n_silos=20, seed=5, group_assignment="random").groups


def test_digits_rotation_groups_really_rotate() -> None:
    originals = original_digits()
    dataset = make_rotated_masked_digits(n_silos=8, seed=2, flatten=False)
    rotated = {
        group: {np.ascontiguousarray(np.rot90(image, k=group)).tobytes() for image in originals} for group in range(4)
    }
    for silo in dataset.silos:
        images = torch.cat([silo.x_train, silo.x_test])[:, 0].numpy()
        # Every image is np.rot90(original, k=group) of some original digit...
        assert all(np.ascontiguousarray(image).tobytes() in rotated[silo.group] for image in images)
        if silo.group != 0:
            # ...and, digits being far from rotation-symmetric, mostly not an unrotated one.
            unrotated = sum(np.ascontiguousarray(image).tobytes() in rotated[0] for image in images)
            assert unrotated < 0.1 * len(images)


def test_digits_masks_are_fixed_per_silo() -> None:
    clean = make_rotated_masked_digits(n_silos=12, seed=4)
    masked = make_rotated_masked_digits(n_silos=12, seed=4, mask_probability=0.3)
    masked_fractions = []
    masks = []
    for silo_clean, silo_masked in zip(clean.silos, masked.silos, strict=True):
        x_clean = torch.cat([silo_clean.x_train, silo_clean.x_test])
        x_masked = torch.cat([silo_masked.x_train, silo_masked.x_test])
        assert torch.equal(silo_clean.y_train, silo_masked.y_train)  # p changes the pixels only
        mask = (x_clean != x_masked).any(dim=0)
        # The masked pixels are zero in every example of the silo; the others are untouched.
        assert torch.all(x_masked[:, mask] == 0.0)
        assert torch.equal(x_masked[:, ~mask], x_clean[:, ~mask])
        masked_fractions.append(float(mask.float().mean()))
        masks.append(mask)
    # Each silo has its own mask, and about p of the pixels are masked (a pixel whose value is
    # zero anyway cannot show up as changed, so the observed fraction can only fall short of p).
    assert len({tuple(mask.tolist()) for mask in masks}) == 12
    assert 0.15 < float(np.mean(masked_fractions)) <= 0.3 + Z * math.sqrt(0.3 * 0.7 / (12 * 64))


def test_digits_patch_masks_and_white_fill() -> None:
    dataset = make_rotated_masked_digits(
        n_silos=4, seed=9, mask_probability=0.5, patch_size=2, mask_fill=1.0, flatten=False
    )
    for silo in dataset.silos:
        images = torch.cat([silo.x_train, silo.x_test])[:, 0]
        # Pixels that are 1.0 in every image of the silo are its mask (no real ink pixel is at
        # full intensity in every digit); they come in whole 2×2 blocks aligned to the grid.
        always_white = (images == 1.0).all(dim=0)
        blocks = always_white.reshape(4, 2, 4, 2).sum(dim=(1, 3))
        assert set(blocks.unique().tolist()) <= {0, 4}
        assert bool(always_white.any())


def test_digits_label_skew_concentrates_labels() -> None:
    def mean_label_entropy(dataset: FederatedDataset) -> float:
        entropies = []
        for silo in dataset.silos:
            counts = torch.cat([silo.y_train, silo.y_test]).bincount(minlength=10).double()
            p = counts[counts > 0] / counts.sum()
            entropies.append(float(-(p * p.log()).sum()))
        return float(np.mean(entropies))

    iid = make_rotated_masked_digits(n_silos=10, seed=0)
    skewed = make_rotated_masked_digits(n_silos=10, seed=0, label_skew_alpha=0.1)
    assert sum(s.n_train + s.n_test for s in skewed.silos) == 1797
    assert mean_label_entropy(skewed) < 0.6 * mean_label_entropy(iid)
    assert_same_dataset(skewed, make_rotated_masked_digits(n_silos=10, seed=0, label_skew_alpha=0.1))


def test_digits_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"mask_probability must be in \[0, 1\]. Found 1.5"):
        make_rotated_masked_digits(n_silos=4, seed=0, mask_probability=1.5)
    with pytest.raises(ValueError, match=re.escape("patch_size must divide 8. Found 3")):
        make_rotated_masked_digits(n_silos=4, seed=0, patch_size=3)


# --- Liu et al. 2023 Table 1 budgets ------------------------------------------------------------------


@pytest.mark.parametrize("mixture", ["MixGauss1", "MixGauss2", "MixGauss3"])
def test_mixgauss_draws_match_table_1(mixture: str) -> None:
    n = 200_000
    draw = draw_budgets(cast(MixtureName, mixture), n_silos=n, seed=1)
    assert draw.epsilons.shape == (n,) and draw.components.shape == (n,)
    assert np.all(draw.epsilons > 0.0)
    for index, component in enumerate(MIXGAUSS_TABLE[mixture]):
        members = draw.epsilons[draw.components == index]
        weight = members.size / n
        assert abs(weight - component.weight) <= Z * math.sqrt(component.weight * (1 - component.weight) / n)
        assert abs(members.mean() - component.mean) <= Z * component.std / math.sqrt(members.size)
        assert abs(members.std() - component.std) <= Z * component.std * math.sqrt(1 / (2 * (members.size - 1)))


def test_mixgauss_table_and_draw_properties() -> None:
    assert [(c.weight, c.mean, c.std) for c in MIXGAUSS_TABLE["MixGauss3"]] == [
        (0.5, 0.1, 0.01),
        (0.4, 1.0, 0.1),
        (0.1, 10.0, 1.0),
    ]
    for components in MIXGAUSS_TABLE.values():
        assert sum(c.weight for c in components) == pytest.approx(1.0)
    a = draw_budgets("MixGauss2", n_silos=30, seed=8)
    b = draw_budgets("MixGauss2", n_silos=30, seed=8)
    assert np.array_equal(a.epsilons, b.epsilons) and np.array_equal(a.components, b.components)
    assert not np.array_equal(a.epsilons, draw_budgets("MixGauss2", n_silos=30, seed=9).epsilons)
    with pytest.raises(ValueError):
        a.epsilons[0] = 1.0  # read-only
    # The floor clips: every MixGauss1 component-0 draw (~0.1) is lifted to 0.5.
    clipped = draw_budgets("MixGauss1", n_silos=1000, seed=0, min_epsilon=0.5)
    assert np.all(clipped.epsilons[clipped.components == 0] == 0.5)
    with pytest.raises(ValueError, match="mixture must be one of"):
        draw_budgets("MixGauss4", n_silos=3, seed=0)  # type: ignore[arg-type]  # a name outside the Literal, on purpose


# --- user .npz folders --------------------------------------------------------------------------


def test_npz_round_trip_with_test_arrays(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    written = {}
    for name, group in (("b_hospital", 1), ("a_clinic", 0)):
        arrays = {
            "x": rng.normal(size=(12, 2, 3)).astype(np.float32),
            "y": rng.integers(0, 4, size=12),
            "x_test": rng.normal(size=(5, 2, 3)).astype(np.float32),
            "y_test": rng.integers(0, 4, size=5),
            "group": np.array(group),
        }
        np.savez(tmp_path / f"{name}.npz", **arrays)  # type: ignore[arg-type]  # numpy types **kwds narrower than arrays
        written[name] = arrays
    dataset = load_npz_folder(tmp_path, seed=0)
    assert dataset.task == "classification" and dataset.n_features == 6
    assert [s.name for s in dataset.silos] == ["a_clinic", "b_hospital"] and dataset.groups == (0, 1)
    assert dataset.n_classes == 1 + max(int(max(a["y"].max(), a["y_test"].max())) for a in written.values())
    for silo in dataset.silos:
        arrays = written[silo.name]
        assert np.array_equal(silo.x_train.numpy(), arrays["x"]) and np.array_equal(silo.y_train.numpy(), arrays["y"])
        assert np.array_equal(silo.x_test.numpy(), arrays["x_test"])
        assert np.array_equal(silo.y_test.numpy(), arrays["y_test"])


def test_npz_seeded_split_and_regression(tmp_path: Path) -> None:
    x = np.arange(40, dtype=np.float64).reshape(20, 2)
    y = np.linspace(0.0, 1.0, 20)
    np.savez(tmp_path / "only.npz", x=x, y=y)
    dataset = load_npz_folder(tmp_path, seed=3)
    silo = dataset[0]
    assert dataset.task == "regression" and dataset.n_classes is None and dataset.n_features == 2
    assert (silo.n_train, silo.n_test) == (15, 5)
    # A split, not a resample: together the two halves are exactly the file's rows.
    rows = torch.cat([silo.x_train, silo.x_test]).numpy()
    assert np.array_equal(np.sort(rows[:, 0]), x[:, 0])
    assert_same_dataset(dataset, load_npz_folder(tmp_path, seed=3))
    assert not torch.equal(silo.x_test, load_npz_folder(tmp_path, seed=4)[0].x_test)


def test_npz_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    np.savez(tmp_path / "good.npz", x=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    np.savez(tmp_path / "nolabels.npz", x=np.zeros((4, 2)))
    with pytest.raises(SiloFileError, match=r"nolabels\.npz: missing key 'y' \(found keys: \['x'\]\)"):
        load_npz_folder(tmp_path, seed=0)

    (tmp_path / "nolabels.npz").unlink()
    np.savez(tmp_path / "half.npz", x=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64), x_test=np.zeros((2, 2)))
    with pytest.raises(SiloFileError, match=r"half\.npz: missing key 'y_test'"):
        load_npz_folder(tmp_path, seed=0)

    (tmp_path / "half.npz").unlink()
    np.savez(tmp_path / "wide.npz", x=np.zeros((4, 3)), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(SiloFileError, match=r"wide\.npz: examples have shape \(3,\), earlier files have \(2,\)"):
        load_npz_folder(tmp_path, seed=0)

    (tmp_path / "wide.npz").unlink()
    np.savez(tmp_path / "reals.npz", x=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(SiloFileError, match=r"reals\.npz: labels look like 'regression'"):
        load_npz_folder(tmp_path, seed=0)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SiloFileError, match=r"empty: no \.npz files"):
        load_npz_folder(empty, seed=0)
    with pytest.raises(SiloFileError, match="not a directory"):
        load_npz_folder(tmp_path / "missing", seed=0)
