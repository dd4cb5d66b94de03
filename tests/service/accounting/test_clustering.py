"""Privacy groups from the norms of noisy updates (Liu et al. 2023 §4.1): synthetic norms, the contract,
and the issue's acceptance check on a real warm-start round of DP-SGD over NIID digits silos."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch.func import grad, vmap

from dpledger.service.accounting.clustering import Grouping, cluster_norms
from dpledger.service.accounting.reports import calibrate_dpsgd_noise, dpsgd_epsilon
from dpledger.trainer.data.budgets import MIXGAUSS_TABLE, MixtureName, draw_budgets
from dpledger.trainer.data.digits import make_rotated_masked_digits


def partition(grouping: Grouping, silo_ids: list[int]) -> list[int]:
    return [grouping.groups[s] for s in silo_ids]


# ----- synthetic norms ---------------------------------------------------------------------------


def test_two_well_separated_groups_are_recovered_in_order_of_mean() -> None:
    rng = np.random.default_rng(0)
    noisy = rng.normal(40.0, 2.0, size=6)
    quiet = rng.normal(3.0, 0.2, size=4)
    norms = {10 + i: float(v) for i, v in enumerate(np.concatenate([noisy, quiet]))}
    grouping = cluster_norms(norms)
    assert grouping.n_components == 2
    assert partition(grouping, list(norms)) == [1] * 6 + [0] * 4
    assert [c.size for c in grouping.components] == [4, 6]
    assert grouping.components[0].mean_norm == pytest.approx(float(quiet.mean()))
    assert grouping.components[1].std_norm == pytest.approx(float(noisy.std()))


def test_three_well_separated_groups_are_recovered_in_order_of_mean() -> None:
    rng = np.random.default_rng(1)
    levels = [(100.0, 5.0, 4), (1.0, 0.05, 3), (10.0, 0.5, 5)]
    values = np.concatenate([rng.normal(mean, std, size=n) for mean, std, n in levels])
    expected = [2] * 4 + [0] * 3 + [1] * 5
    for seed in range(5):
        grouping = cluster_norms({i: float(v) for i, v in enumerate(values)}, seed=seed)
        assert grouping.n_components == 3
        assert partition(grouping, list(range(12))) == expected
    means = [c.mean_norm for c in grouping.components]
    assert means == sorted(means)


def test_a_single_tight_group_is_one_component() -> None:
    for seed in range(5):
        values = np.random.default_rng(seed).normal(5.0, 0.05, size=10)
        grouping = cluster_norms({i: float(v) for i, v in enumerate(values)})
        assert grouping.n_components == 1
        assert set(grouping.groups.values()) == {0}
        assert grouping.components[0].size == 10


def test_fewer_than_three_reports_are_one_group() -> None:
    assert cluster_norms({7: 1.0, 8: 100.0}).groups == {7: 0, 8: 0}
    one = cluster_norms({3: 2.5})
    assert one.groups == {3: 0} and one.n_components == 1
    assert one.components[0].mean_norm == 2.5 and one.components[0].std_norm == 0.0


def test_never_more_components_than_distinct_values_or_max_components() -> None:
    grouping = cluster_norms({i: 1.0 if i < 4 else 50.0 for i in range(8)})
    assert grouping.n_components == 2
    assert cluster_norms({i: 3.0 for i in range(6)}).n_components == 1
    values = {i: float(v) for i, v in enumerate([1.0, 1.1, 10.0, 11.0, 100.0, 110.0])}
    assert cluster_norms(values).n_components == 3
    assert cluster_norms(values, max_components=2).n_components <= 2
    assert cluster_norms(values, max_components=1).n_components == 1


def test_deterministic_and_a_function_of_the_norms_only() -> None:
    rng = np.random.default_rng(2)
    values = np.concatenate([rng.normal(2.0, 0.1, 7), rng.normal(9.0, 0.5, 3)])
    norms = {i: float(v) for i, v in enumerate(values)}
    first = cluster_norms(norms)
    assert cluster_norms(norms) == first
    # The mapping's order, the silo ids and the unit of the norms change nothing: cluster_norms
    # takes no budget (its signature has none) and reads nothing but these numbers.
    shuffled = dict(reversed(list(norms.items())))
    assert cluster_norms(shuffled).groups == first.groups
    relabelled = cluster_norms({1000 - i: v for i, v in norms.items()})
    assert all(relabelled.groups[1000 - i] == g for i, g in first.groups.items())
    rescaled = cluster_norms({i: v * 1000.0 for i, v in norms.items()})
    assert rescaled.groups == first.groups
    assert [c.mean_norm for c in rescaled.components] == pytest.approx([c.mean_norm * 1000.0 for c in first.components])


def test_a_zero_norm_is_the_least_noisy() -> None:
    grouping = cluster_norms({0: 0.0, 1: 5.0, 2: 5.1, 3: 4.9, 4: 5.05})
    assert grouping.groups[0] == 0
    assert {grouping.groups[i] for i in range(1, 5)} == {grouping.n_components - 1}


@pytest.mark.parametrize(
    ("norms", "message"),
    [
        ({1: 1.0, 2: float("nan")}, "Norm of silo 2 must be finite. Found nan."),
        ({1: 1.0, 5: float("inf")}, "Norm of silo 5 must be finite. Found inf."),
        ({4: -0.5, 1: 1.0}, r"Norm of silo 4 must be >= 0 \(an L2 norm\). Found -0.5."),
        ({9: "3"}, "Norm of silo 9 must be a number. Found '3'."),
        ({"a": 1.0}, "Silo ids must be integers. Found 'a'."),
        ({}, "norms must hold at least one silo's report. Found none."),
    ],
)
def test_bad_norms_are_refused_naming_the_silo(norms: dict[Any, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cluster_norms(norms)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("max_components must be an integer >= 1. Found 0.")):
        cluster_norms({1: 1.0}, max_components=0)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\). Found -1."):
        cluster_norms({1: 1.0}, seed=-1)


# ----- the acceptance check: a real warm-start round ----------------------------------
#
# Liu et al. 2023 §4.1 / Alg. 1 line 4: every silo runs one round of local DP-SGD (logistic regression,
# as in the paper's MNIST-LogR) with the noise its own budget needs, reports the L2 norm of its
# noisy update, and the norms alone must recover the budget-based groups (Table 1's components).
#
# Every silo runs the same (q, T), so σ depends on ε alone. Silos are cut to the size of the
# smallest one: the noise of DP-SGD's averaged gradient scales with 1/(q·n_k) just as it scales
# with σ(ε_k), so unequal sizes would make the norms measure dataset size as much as budget (paper
# 001 §3.1's NIID(2) is the usual split of MNIST into equal shards of two labels each). Label skew
# stays: Dir(0.5), the paper's NIID-Dir(0.5). Without the cut, the same pipeline put 88.5/60/37%
# of silos in their budget group for MixGauss1/2/3 (silo sizes varied ±40%).

N_SILOS = 10
SEEDS = range(20)
SAMPLING_RATE = 0.25
STEPS = 8
LEARNING_RATE = 0.5
CLIP_NORM = 1.0
DELTA = 1e-5
LABEL_SKEW_ALPHA = 0.5
# σ grid for calibration: σ_i = SIGMA_0·SIGMA_RATIO^i. Each silo takes the smallest grid σ whose
# exact ε (dp-accounting, via the service's own report function) is within its budget: never over
# budget, and at most 2% more noise than `calibrate_dpsgd_noise` would give. About 70 ε evaluations
# serve all 600 silos, where 600 calibrations would take minutes.
SIGMA_0 = 0.3
SIGMA_RATIO = 1.02
SIGMA_GRID_SIZE = 600


_GRID_EPSILONS: dict[int, float] = {}


def grid_epsilon(index: int) -> float:
    if index not in _GRID_EPSILONS:
        _GRID_EPSILONS[index] = dpsgd_epsilon(
            noise_multiplier=SIGMA_0 * SIGMA_RATIO**index, sampling_rate=SAMPLING_RATE, steps=STEPS, delta=DELTA
        )
    return _GRID_EPSILONS[index]


def grid_sigma(epsilon: float) -> float:
    """The smallest grid σ with ε(σ) ≤ epsilon, by bisection (ε falls as σ grows), starting from
    the tightest bracket the indices already evaluated give, so nearby budgets cost few new ε."""
    low, high = -1, SIGMA_GRID_SIZE - 1
    if grid_epsilon(high) > epsilon:
        raise ValueError(f"epsilon {epsilon} is below the σ grid's reach.")
    for index, value in _GRID_EPSILONS.items():
        if value <= epsilon:
            high = min(high, index)
        else:
            low = max(low, index)
    while high - low > 1:
        middle = (low + high) // 2
        if grid_epsilon(middle) <= epsilon:
            high = middle
        else:
            low = middle
    return SIGMA_0 * SIGMA_RATIO**high


def softmax_regression_step_sums(
    weights: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor, included: torch.Tensor
) -> torch.Tensor:
    """[K, P] Σ_i clip_C(∇ℓ_i) over the included examples of each silo, P = 64·10 + 10.

    For softmax regression ∇_W ℓ_i = x_i r_iᵀ and ∇_b ℓ_i = r_i with r_i = softmax(W x_i + b) − e_{y_i},
    so ‖∇ℓ_i‖² = (‖x_i‖² + 1)·‖r_i‖² and the clipped sum is one matmul: no [K, n, P] tensor.
    `test_closed_form_gradients_match_torch_func` checks this against torch.func per example.
    """
    # bmm rather than einsum: several times faster for these small batched products on CPU.
    residual = torch.softmax(torch.bmm(x, weights) + bias[:, None], dim=-1)
    residual = residual - torch.nn.functional.one_hot(y, residual.shape[-1]).to(residual.dtype)
    norms = torch.sqrt((x.pow(2).sum(-1) + 1.0) * residual.pow(2).sum(-1))
    factors = torch.where(included, CLIP_NORM / norms.clamp(min=CLIP_NORM), torch.zeros((), dtype=x.dtype))
    scaled = residual * factors[..., None]
    return torch.cat([torch.bmm(x.transpose(1, 2), scaled).flatten(1), scaled.sum(1)], dim=1)


def test_closed_form_gradients_match_torch_func() -> None:
    g = torch.Generator().manual_seed(0)
    k, n = 2, 5
    x = torch.rand(k, n, 64, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (k, n), generator=g)
    weights = torch.randn(k, 64, 10, generator=g, dtype=torch.float64) * 0.3
    bias = torch.randn(k, 10, generator=g, dtype=torch.float64) * 0.3
    included = torch.tensor([[True, False, True, True, False], [True, True, True, True, True]])

    def loss(w: torch.Tensor, b: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy((xi @ w + b)[None], yi[None])

    per_example = vmap(vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0)), in_dims=(0, 0, 0, 0))
    grad_w, grad_b = per_example(weights, bias, x, y)
    flat = torch.cat([grad_w.flatten(2), grad_b], dim=2)
    clipped = flat * (CLIP_NORM / torch.linalg.vector_norm(flat, dim=2, keepdim=True).clamp(min=CLIP_NORM))
    expected = (clipped * included[..., None]).sum(1)
    assert torch.allclose(softmax_regression_step_sums(weights, bias, x, y, included), expected, atol=1e-12)


def warm_start_norms(x: torch.Tensor, y: torch.Tensor, sigmas: torch.Tensor, *, seed: int) -> np.ndarray:
    """One warm-start round of DP-SGD per silo from a zero model (Liu et al. 2023 Alg. 1 line 4): STEPS
    Poisson-sampled steps at rate q, noise N(0, σ_k²C²) on the clipped sum, divided by the expected
    batch q·n. Returns ‖Δ_k‖ per silo. x: [K, n, 64], y: [K, n], sigmas: [K]."""
    k, n, _ = x.shape
    g = torch.Generator().manual_seed(seed)
    weights = torch.zeros(k, 64, 10, dtype=x.dtype)
    bias = torch.zeros(k, 10, dtype=x.dtype)
    for _ in range(STEPS):
        included = torch.rand(k, n, generator=g, dtype=x.dtype) < SAMPLING_RATE
        sums = softmax_regression_step_sums(weights, bias, x, y, included)
        noisy = sums + torch.randn(sums.shape, generator=g, dtype=x.dtype) * (sigmas[:, None] * CLIP_NORM)
        step = LEARNING_RATE * noisy / (SAMPLING_RATE * n)
        weights = weights - step[:, :640].reshape(k, 64, 10)
        bias = bias - step[:, 640:]
    return torch.linalg.vector_norm(torch.cat([weights.flatten(1), bias], dim=1), dim=1).numpy()


def budget_groups(components: np.ndarray, mixture: str) -> np.ndarray:
    """The budget-based partition, numbered like `cluster_norms`: 0 for the present component with
    the largest mean ε (the least noise), then by decreasing ε."""
    means = [c.mean for c in MIXGAUSS_TABLE[mixture]]
    present = sorted(set(components.tolist()), key=lambda c: -means[c])
    return np.array([present.index(c) for c in components.tolist()])


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int
    per_seed: tuple[int, ...]

    @property
    def rate(self) -> float:
        return self.correct / self.total


def measure_warm_start_accuracy() -> dict[str, Accuracy]:
    """Per mixture, how many silos `cluster_norms` puts in their budget group, over SEEDS."""
    counts: dict[str, list[int]] = {name: [] for name in MIXGAUSS_TABLE}
    # These tensors are tiny: a second intra-op thread only adds synchronisation, which costs
    # several times the work itself on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for seed in SEEDS:
            count_seed(seed, counts)
    finally:
        torch.set_num_threads(threads)
    return {
        mixture: Accuracy(correct=sum(c), total=N_SILOS * len(c), per_seed=tuple(c)) for mixture, c in counts.items()
    }


def count_seed(seed: int, counts: dict[str, list[int]]) -> None:
    """Append, per mixture, how many of this seed's silos land in their budget group."""
    data = make_rotated_masked_digits(n_silos=N_SILOS, seed=seed, label_skew_alpha=LABEL_SKEW_ALPHA)
    n = min(silo.n_train for silo in data.silos)
    x = torch.stack([silo.x_train[:n] for silo in data.silos]).to(torch.float64)
    y = torch.stack([silo.y_train[:n] for silo in data.silos])
    for index, mixture in enumerate(MIXGAUSS_TABLE):
        draw = draw_budgets(cast(MixtureName, mixture), n_silos=N_SILOS, seed=seed)
        sigmas = torch.tensor([grid_sigma(float(e)) for e in draw.epsilons], dtype=torch.float64)
        norms = warm_start_norms(x, y, sigmas, seed=1000 * seed + index)
        grouping = cluster_norms({silo: float(norm) for silo, norm in enumerate(norms)})
        predicted = np.array([grouping.groups[silo] for silo in range(N_SILOS)])
        counts[mixture].append(int((predicted == budget_groups(draw.components, mixture)).sum()))


@pytest.fixture(scope="module")
def warm_start_accuracy() -> dict[str, Accuracy]:
    return measure_warm_start_accuracy()


def test_sigma_grid_is_conservative_and_close_to_calibration() -> None:
    # One budget only: a calibration takes about a second.
    epsilon = 1.0
    sigma = grid_sigma(epsilon)
    calibrated, _ = calibrate_dpsgd_noise(epsilon=epsilon, delta=DELTA, sampling_rate=SAMPLING_RATE, steps=STEPS)
    assert calibrated <= sigma <= calibrated * SIGMA_RATIO * (1 + 1e-9)
    assert dpsgd_epsilon(noise_multiplier=sigma, sampling_rate=SAMPLING_RATE, steps=STEPS, delta=DELTA) <= epsilon


@pytest.mark.parametrize("mixture", ["MixGauss1", "MixGauss2"])
def test_norm_clustering_recovers_budget_groups_for_90_percent_of_silos(
    mixture: str, warm_start_accuracy: dict[str, Accuracy]
) -> None:
    accuracy = warm_start_accuracy[mixture]
    assert accuracy.total == N_SILOS * len(SEEDS)
    assert accuracy.rate >= 0.90, (mixture, accuracy)


def test_norm_clustering_on_mixgauss3(warm_start_accuracy: dict[str, Accuracy]) -> None:
    # The issue asks only to report this figure; it is pinned near its measured value (see the
    # LOG_STD_FLOOR comment in service/accounting/clustering.py) so that a regression shows.
    accuracy = warm_start_accuracy["MixGauss3"]
    assert accuracy.rate >= 0.90, accuracy
