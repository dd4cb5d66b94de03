"""The ServerApp's group-wise aggregation (dpledger.flower.grouped) against numpy computations of
Liu et al. 2023 Alg. 1 (PFA) and FedHDP Alg. 2 with the budget-blind ratio."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpledger.flower.grouped import aggregate, fixed_groups


def test_a_silo_without_a_warm_start_norm_goes_to_the_noisiest_group() -> None:
    assert fixed_groups({4: 0, 5: 1}, [4, 5, 6]) == {4: 0, 5: 1, 6: 1}
    assert fixed_groups({}, [1, 2]) == {1: 0, 2: 0}


def test_pfa_projects_the_noisier_mean_onto_the_least_noisy_group_still_present() -> None:
    rng = np.random.default_rng(0)
    updates = rng.normal(size=(5, 8))
    updates[2:] *= 5.0
    # Group 0 has stopped: group 1 (silos 0, 1) is now the public one, groups 2 and 3 are private.
    result = aggregate("pfa", torch.tensor(updates), [1, 1, 2, 2, 3]).numpy()
    public, private = updates[:2], updates[2:]
    basis = public.T  # its span is the top-2 subspace of two public updates
    projected = basis @ np.linalg.lstsq(basis, private.mean(0), rcond=None)[0]
    np.testing.assert_allclose(result, (2 / 5) * public.mean(0) + (3 / 5) * projected, rtol=1e-10, atol=1e-12)


def test_one_group_is_plain_averaging() -> None:
    updates = np.random.default_rng(1).normal(size=(3, 4))
    for algorithm in ("pfa", "fedhdp"):
        np.testing.assert_allclose(aggregate(algorithm, torch.tensor(updates), [2, 2, 2]).numpy(), updates.mean(0),
                                   rtol=1e-12)


def test_fedhdp_weighs_the_noisier_group_by_the_ratio_of_within_group_variances() -> None:
    rng = np.random.default_rng(2)
    shared = rng.normal(size=50)
    quiet = shared + rng.normal(scale=0.5, size=(3, 50))
    noisy = shared + rng.normal(scale=3.0, size=(2, 50))
    result = aggregate("fedhdp", torch.tensor(np.vstack([quiet, noisy])), [0, 0, 0, 1, 1]).numpy()

    def variance(group: np.ndarray) -> float:  # unbiased within-group variance per coordinate
        return float(((group - group.mean(0)) ** 2).sum() / ((len(group) - 1) * group.shape[1]))

    r = min(1.0, variance(quiet) / variance(noisy))
    assert 0.0 < r < 0.2  # the noisy group's variance is ~36× larger
    expected = (3 * quiet.mean(0) + r * 2 * noisy.mean(0)) / (3 + 2 * r)
    np.testing.assert_allclose(result, expected, rtol=1e-10)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"one group per update: 2 groups for updates of shape \(3, 4\)"):
        aggregate("pfa", torch.zeros(3, 4, dtype=torch.float64), [0, 1])
    with pytest.raises(ValueError, match=r"algorithm must be one of \['pfa', 'fedhdp'\]. Found 'fedavg'"):
        aggregate("fedavg", torch.zeros(2, 4, dtype=torch.float64), [0, 1])
