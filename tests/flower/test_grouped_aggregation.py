"""The ServerApp's group-wise aggregation (the PFA and FedHDP server halves, by the groups
dpledger.flower.grouped fixes) against numpy computations of Liu et al. 2023 Alg. 1 (PFA) and
FedHDP Alg. 2 with the budget-blind ratio."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpledger.flower.grouped import fixed_groups
from dpledger.trainer.federated import registry
from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.federated.halves import ServerStart
from dpledger.trainer.federated.pfa import UPDATE, GroupServer


def aggregate(algorithm: str, updates: torch.Tensor, groups: list[int]) -> torch.Tensor:
    """The global update the algorithm's server half makes of the silos' `updates` ([A, P]) in an
    aggregation round, every silo trained and in the given (fixed, uncompacted) group."""
    options = {"ratio": "budget_blind"} if algorithm == "fedhdp" else {}
    start = ServerStart(initial=torch.zeros(updates.shape[1], dtype=updates.dtype), num_silos=len(groups),
                        fresh_model=lambda j: torch.zeros(0), record=lambda kind, members, mechanism: None,
                        noise=torch.Generator())
    server = registry.algorithms()[algorithm].halves(DPSGDConfig(), **options).server(start)
    assert isinstance(server, GroupServer)
    server.set_groups(groups)
    server.aggregate(1, torch.arange(len(groups)), {UPDATE: updates})
    return server.global_model


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


def test_an_aggregation_round_needs_the_groups_first() -> None:
    server = registry.algorithms()["pfa"].halves(DPSGDConfig()).server(ServerStart(
        initial=torch.zeros(4), num_silos=2, fresh_model=lambda j: torch.zeros(0),
        record=lambda kind, members, mechanism: None, noise=torch.Generator()))
    with pytest.raises(RuntimeError, match="Round 1 aggregates by privacy group: set the groups"):
        server.aggregate(1, torch.arange(2), {UPDATE: torch.zeros(2, 4)})
    with pytest.raises(ValueError, match=r"groups must hold one group id >= 0 per silo \(2\). Found \[0\]"):
        server.set_groups([0])  # type: ignore[attr-defined]  # a GroupServer
