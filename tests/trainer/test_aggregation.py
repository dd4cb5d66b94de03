"""Server-side aggregation: PFA (Liu et al. 2023 Alg. 1), FedHDP's two-step average and ratio (FedHDP
§3.1.2, Lemma 1), and adaptive clipping by a noisy
quantile (FedHDP Alg. 2). PMTL ("Private Multi-Task Learning", Alg. 1) is research code:
tests/research/test_pmtl.py."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from pydantic import TypeAdapter

from dpledger.trainer.aggregation import (
    budget_blind_ratio,
    clip_updates,
    estimate_noise_variance_from_norms,
    fedhdp_aggregate,
    group_means,
    noisy_quantile_clip_update,
    optimal_ratio,
    pfa_aggregate,
    project_onto,
    public_mask,
    top_k_subspace,
)
from dpledger.wire.mechanisms import Mechanism

WIRE = TypeAdapter(Mechanism)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def orthonormal_basis(p: int, k: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(p, k, generator=generator(seed), dtype=torch.float64))
    return q


# ----- PFA (Liu et al. 2023 Alg. 1) ------------------------------------------------------------------


def test_subspace_of_updates_in_a_k_dim_subspace_keeps_a_mean_in_it_and_removes_an_orthogonal_part() -> None:
    p, k = 50, 3
    basis = orthonormal_basis(p, k, seed=0)
    public = torch.randn(8, k, generator=generator(1), dtype=torch.float64) @ basis.T
    found = top_k_subspace(public, k=k)
    assert torch.allclose(found.T @ found, torch.eye(k, dtype=torch.float64), atol=1e-12)
    inside = basis @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    assert torch.allclose(project_onto(inside, found), inside, atol=1e-12)
    raw = torch.randn(p, generator=generator(2), dtype=torch.float64)
    orthogonal = raw - basis @ (basis.T @ raw)
    assert orthogonal.norm() > 1.0
    assert torch.allclose(project_onto(inside + orthogonal, found), inside, atol=1e-12)
    assert project_onto(orthogonal, found).norm() < 1e-12


def test_top_k_subspace_is_the_top_eigenspace_of_the_second_moment_matrix() -> None:
    updates = torch.randn(12, 30, generator=generator(3), dtype=torch.float64)
    updates[:, :4] *= torch.tensor([8.0, 6.0, 4.0, 3.0], dtype=torch.float64)  # distinct top eigenvalues
    k = 3
    _, eigenvectors = torch.linalg.eigh(updates.T @ updates / updates.shape[0])
    top = eigenvectors[:, -k:]
    found = top_k_subspace(updates, k=k)
    assert torch.allclose(found @ found.T, top @ top.T, atol=1e-9)


def test_pfa_combines_public_mean_and_projected_private_mean_by_group_size() -> None:
    p, k = 40, 2
    basis = orthonormal_basis(p, k, seed=4)
    n_public, n_private = 3, 5
    public_updates = torch.randn(n_public, k, generator=generator(5), dtype=torch.float64) @ basis.T
    private_signal = torch.randn(n_private, k, generator=generator(6), dtype=torch.float64) @ basis.T
    noise = torch.randn(n_private, p, generator=generator(7), dtype=torch.float64) * 10.0
    noise = noise - (noise @ basis) @ basis.T  # the part of the private noise PFA can remove
    updates = torch.cat([private_signal[:2], public_updates, private_signal[2:]]) + torch.cat(
        [noise[:2], torch.zeros(n_public, p, dtype=torch.float64), noise[2:]]
    )
    public = torch.tensor([False, False, True, True, True, False, False, False])
    expected = (n_public * public_updates.mean(0) + n_private * private_signal.mean(0)) / (n_public + n_private)
    assert torch.allclose(pfa_aggregate(updates, public, k=k), expected, atol=1e-10)
    # FedAvg would keep the noise; PFA's answer is closer to the signal-only average.
    assert (updates.mean(0) - expected).norm() > 1.0


def test_pfa_with_no_private_silo_is_the_public_mean_and_needs_a_public_one() -> None:
    updates = torch.randn(4, 6, generator=generator(8), dtype=torch.float64)
    assert torch.allclose(pfa_aggregate(updates, torch.ones(4, dtype=torch.bool), k=2), updates.mean(0))
    with pytest.raises(ValueError, match="public must mark at least one silo"):
        pfa_aggregate(updates, torch.zeros(4, dtype=torch.bool), k=1)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, min\(public silos, dimension\)\] = \[1, 2\]"):
        pfa_aggregate(updates, torch.tensor([True, True, False, False]), k=3)
    with pytest.raises(ValueError, match="public must be a bool tensor of shape"):
        pfa_aggregate(updates, torch.tensor([1, 1, 0, 0]), k=1)


def test_public_mask_takes_the_least_noisy_groups() -> None:
    groups = torch.tensor([2, 0, 1, 0, 2])
    assert public_mask(groups).tolist() == [False, True, False, True, False]
    assert public_mask(groups, n_public_groups=2).tolist() == [False, True, True, True, False]


# ----- FedHDP (FedHDP) ------------------------------------------------------------------------


def test_fedhdp_weights_are_n1_over_n1_plus_r_n2() -> None:
    updates = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 10.0], [0.0, 20.0], [0.0, 30.0]], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 1])
    r = 0.25
    w1, w2 = 2 / (2 + r * 3), r * 3 / (2 + r * 3)  # FedHDP §4
    expected = w1 * torch.tensor([2.0, 0.0], dtype=torch.float64) + w2 * torch.tensor([0.0, 20.0], dtype=torch.float64)
    assert torch.allclose(fedhdp_aggregate(updates, groups, ratios=[1.0, r]), expected, atol=1e-12)
    # r = 1 is HDP-FedAvg, the plain mean; r = 0 keeps the least noisy group only.
    assert torch.allclose(fedhdp_aggregate(updates, groups, ratios=[1.0, 1.0]), updates.mean(0))
    assert torch.allclose(fedhdp_aggregate(updates, groups, ratios=[1.0, 0.0]), torch.tensor([2.0, 0.0], dtype=torch.float64))


def test_fedhdp_ignores_an_empty_group_and_validates() -> None:
    updates = torch.tensor([[1.0], [3.0], [10.0]], dtype=torch.float64)
    groups = torch.tensor([0, 0, 2])
    means, counts = group_means(updates, groups, n_groups=3)
    assert counts.tolist() == [2.0, 0.0, 1.0] and means[1].item() == 0.0
    assert fedhdp_aggregate(updates, groups, ratios=[1.0, 0.7, 0.5]).item() == pytest.approx((4.0 + 0.5 * 10.0) / 2.5)
    with pytest.raises(ValueError, match=r"groups must be in \[0, 2\)"):
        fedhdp_aggregate(updates, groups, ratios=[1.0, 0.5])
    with pytest.raises(ValueError, match=r"ratios\[1\] must be a finite number >= 0"):
        fedhdp_aggregate(updates, groups, ratios=[1.0, -0.1, 0.5])
    with pytest.raises(ValueError, match="At least one non-empty group needs a ratio > 0"):
        fedhdp_aggregate(updates, groups, ratios=[0.0, 1.0, 0.0])


def test_optimal_ratio_is_lemma_1() -> None:
    alpha2, tau2, gamma2, rho, n = 10.0, 1.0, 4.0, 0.05, 20
    lemma_1 = (alpha2 + tau2) / (alpha2 + tau2 + (1 - rho) * n * gamma2)
    assert optimal_ratio(client_variance=alpha2 + tau2, noise_variance=(1 - rho) * n * gamma2) == pytest.approx(lemma_1)
    # Two noisy levels: inverse-variance weights, r = (σ_c² + v_ref)/(σ_c² + v).
    assert optimal_ratio(client_variance=1.0, noise_variance=3.0, reference_noise_variance=1.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="noise_variance must be a finite number >= 0"):
        optimal_ratio(client_variance=1.0, noise_variance=-1.0)


def synthetic_updates(
    *, d: int, sizes: list[int], noise_variances: list[float], client_variance: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """u_i = s + h_i + l_i (FedHDP §3.1 per coordinate): a shared signal s, silo deviations h_i of
    variance σ_c², DP noise l_i of variance γ_g² in group g."""
    g = generator(seed)
    signal = 3.0 * torch.randn(d, generator=g, dtype=torch.float64)
    rows, labels = [], []
    for group, (size, variance) in enumerate(zip(sizes, noise_variances, strict=True)):
        deviation = math.sqrt(client_variance) * torch.randn(size, d, generator=g, dtype=torch.float64)
        noise = math.sqrt(variance) * torch.randn(size, d, generator=g, dtype=torch.float64)
        rows.append(signal + deviation + noise)
        labels += [group] * size
    return torch.cat(rows), torch.tensor(labels)


@pytest.mark.parametrize(
    ("sizes", "noise_variances", "client_variance"),
    [
        ([6, 10], [0.0, 19 * 4.0], 11.0),  # FedHDP Fig. 1: non-private reference, (1−ρ)Nγ² = 19·4
        ([6, 10], [0.5, 4.0], 1.0),
        ([6, 10, 8], [0.2, 1.5, 12.0], 1.0),
        ([1, 9], [0.05, 3.0], 1.0),  # MixGauss1 over 10 silos: one lone liberal silo in group 0
        ([1, 5, 4], [0.05, 1.0, 8.0], 1.0),
    ],
    ids=["lemma-1-non-private-reference", "two-private-levels", "three-groups", "lone-group-0", "lone-group-0-of-3"],
)
def test_budget_blind_ratio_is_within_10_percent_of_lemma_1_with_true_variances(
    sizes: list[int], noise_variances: list[float], client_variance: float
) -> None:
    # d = 10 000 coordinates: a lone silo's variance estimate then has a relative standard error of
    # about √(2/d) ≈ 1.4% (plus that of the reference mean), so 10% is several standard errors.
    for seed in range(5):
        updates, groups = synthetic_updates(
            d=10_000, sizes=sizes, noise_variances=noise_variances, client_variance=client_variance, seed=seed
        )
        estimated = budget_blind_ratio(updates, groups)
        assert estimated[0].item() == pytest.approx(1.0)
        for g in range(1, len(noise_variances)):
            true = optimal_ratio(
                client_variance=client_variance,
                noise_variance=noise_variances[g],
                reference_noise_variance=noise_variances[0],
            )
            assert abs(estimated[g].item() / true - 1.0) <= 0.10, (seed, g, estimated[g].item(), true)


def test_noise_variance_from_norms_is_the_excess_over_group_0() -> None:
    variances = [0.3, 2.0, 5.0]
    updates, groups = synthetic_updates(d=4000, sizes=[6, 6, 6], noise_variances=variances, client_variance=1.0, seed=11)
    norms = torch.linalg.vector_norm(updates, dim=1)
    excess = estimate_noise_variance_from_norms(norms, groups, dimension=updates.shape[1])
    assert excess[0].item() == 0.0
    for g in (1, 2):
        assert excess[g].item() == pytest.approx(variances[g] - variances[0], rel=0.10)
    with pytest.raises(ValueError, match=r"Group 0 .* must hold at least one silo"):
        estimate_noise_variance_from_norms(norms[6:], groups[6:], dimension=4000)


def test_budget_blind_ratio_needs_a_group_of_two_and_a_non_empty_group_0() -> None:
    updates = torch.randn(3, 5, generator=generator(12), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"At least one group needs 2 or more silos.*Found group sizes \[1, 1, 1\]"):
        budget_blind_ratio(updates, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"Group 0 .* must hold at least one silo"):
        budget_blind_ratio(updates, torch.tensor([1, 1, 2]))
    # An empty middle group gets ratio 0 and so no weight.
    assert budget_blind_ratio(updates, torch.tensor([0, 0, 2]))[1].item() == 0.0


# ----- adaptive clipping (FedHDP Alg. 2; Andrew et al. 2021) --------------------------------


def test_one_quantile_step_is_the_closed_form_and_declares_its_gaussian() -> None:
    norms = torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    step = noisy_quantile_clip_update(
        norms, clip_norm=3.0, target_quantile=0.5, learning_rate=0.2, noise_multiplier=1e-9, generator=generator(0)
    )
    fraction = 3 / 5  # 0.5, 1, 2 fit under 3
    assert step.clip_norm == pytest.approx(3.0 * math.exp(-0.2 * (fraction - 0.5)), rel=1e-9)
    assert step.mechanism.model_dump() == {"type": "gaussian", "noise_multiplier": 1e-9}
    WIRE.validate_python(step.mechanism.model_dump())
    # The noise is σ_b on the count, i.e. σ_b/N on the fraction, drawn from the given generator.
    noisy = noisy_quantile_clip_update(
        norms, clip_norm=3.0, target_quantile=0.5, learning_rate=0.2, noise_multiplier=2.0, generator=generator(0)
    )
    z = torch.randn((), generator=generator(0), dtype=torch.float64).item()
    assert noisy.noisy_fraction == pytest.approx(fraction + 2.0 * z / 5, rel=1e-12)
    assert noisy.clip_norm == pytest.approx(3.0 * math.exp(-0.2 * (noisy.noisy_fraction - 0.5)), rel=1e-12)
    assert noisy.mechanism.model_dump() == {"type": "gaussian", "noise_multiplier": 2.0}


def test_clip_moves_geometrically_to_the_target_quantile() -> None:
    norms = torch.exp(torch.linspace(0.0, math.log(100.0), 201, dtype=torch.float64))  # 1 … 100
    kappa, eta = 0.3, 0.1
    target = torch.quantile(norms, kappa).item()
    clip, g = 1000.0, generator(1)
    history = [clip]
    for _ in range(400):
        clip = noisy_quantile_clip_update(
            norms, clip_norm=clip, target_quantile=kappa, learning_rate=eta, noise_multiplier=1e-9, generator=g
        ).clip_norm
        history.append(clip)
    # While every norm fits (fraction 1), each step multiplies the clip by exactly e^{−η(1−κ)}.
    for before, after in itertools.pairwise(history):
        if before < norms.max().item():
            break
        assert after / before == pytest.approx(math.exp(-eta * (1 - kappa)), rel=1e-9)
    # Then it settles at the κ-quantile: within one step's factor e^{η} of it.
    for late in history[-50:]:
        assert target * math.exp(-eta) <= late <= target * math.exp(eta)
    late_fractions = [float((norms <= c).double().mean()) for c in history[-50:]]
    assert abs(sum(late_fractions) / len(late_fractions) - kappa) < 0.02


def test_quantile_update_refuses_a_noiseless_query_and_bad_inputs() -> None:
    norms = torch.tensor([1.0, 2.0, 3.0])
    kwargs = {"clip_norm": 1.0, "target_quantile": 0.5, "learning_rate": 0.2, "generator": generator(0)}
    with pytest.raises(ValueError, match=re.escape("noise_multiplier must be a finite number > 0. Found 0.0")):
        noisy_quantile_clip_update(norms, noise_multiplier=0.0, **kwargs)
    with pytest.raises(ValueError, match=r"target_quantile must be in \(0, 1\)"):
        noisy_quantile_clip_update(norms, noise_multiplier=1.0, **{**kwargs, "target_quantile": 1.0})
    with pytest.raises(ValueError, match="update_norms must be finite and >= 0"):
        noisy_quantile_clip_update(torch.tensor([1.0, -1.0]), noise_multiplier=1.0, **kwargs)


def test_clip_updates_bounds_norms_and_keeps_short_ones() -> None:
    updates = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    clipped = clip_updates(updates, clip_norm=1.0)
    assert torch.allclose(clipped, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64))
