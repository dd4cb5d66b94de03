"""FedHDP's two-step aggregation and its weight ratio r (FedHDP §3.1.2 and §4, Alg. 2).

Step 1 averages the updates of each privacy group; step 2 takes a weighted average of the group
means, where a silo of a noisier group weighs r times a silo of the least noisy one:
w_g ∝ r_g·N_g (FedHDP §4: w_1 = N_1/(N_1 + rN_2), w_2 = rN_2/(N_1 + rN_2)). Lemma 1 gives the r
that minimises the server's error when the variances are known; `budget_blind_ratio` estimates it
from the updates alone, so the coordinator needs no budget (Liu et al. 2023's setting).

In the cross-silo worker each silo's update is already private (local DP-SGD), so the averages
here are post-processing and cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dpledger.trainer.aggregation._checks import (
    check_groups,
    check_non_negative,
    check_updates,
)


def _n_groups(groups: torch.Tensor, n_groups: int | None) -> int:
    if n_groups is None:
        return int(groups.max()) + 1 if groups.numel() else 0
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be an integer >= 1. Found {n_groups!r}.")
    return n_groups


def group_means(
    updates: torch.Tensor, groups: torch.Tensor, *, n_groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 (FedHDP eq. (12)): ([G, P] mean update of each group, [G] group sizes).
    An empty group's mean is all zeros and its size 0."""
    check_updates(updates)
    g = _n_groups(groups, n_groups)
    check_groups(groups, n=updates.shape[0], n_groups=g)
    index = groups.to(device=updates.device, dtype=torch.int64)
    sums = torch.zeros(g, updates.shape[1], dtype=updates.dtype, device=updates.device).index_add_(0, index, updates)
    counts = torch.bincount(index, minlength=g).to(updates.dtype)
    return sums / counts.clamp(min=1).unsqueeze(1), counts


def fedhdp_aggregate(
    updates: torch.Tensor, groups: torch.Tensor, *, ratios: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Σ_g w_g θ̄_g with w_g = r_g N_g / Σ_h r_h N_h (FedHDP §4, Alg. 2 step 2; §3.1.2 for two
    groups). `ratios[g]` is r_g, the weight of one silo of group g relative to the others; give the
    least noisy group 1 and each noisier group its `optimal_ratio` / `budget_blind_ratio`. All ratios
    equal is FedAvg over silos (HDP-FedAvg, r = 1). Returns the aggregate update [P]."""
    ratio_tensor = torch.as_tensor(ratios, dtype=torch.float64).flatten()
    if ratio_tensor.numel() < 1:
        raise ValueError("ratios must hold one ratio per group. Found none.")
    for g, r in enumerate(ratio_tensor.tolist()):
        check_non_negative(r, name=f"ratios[{g}]")
    means, counts = group_means(updates, groups, n_groups=ratio_tensor.numel())
    mass = ratio_tensor.to(updates.dtype).to(updates.device) * counts
    if float(mass.sum()) <= 0.0:
        raise ValueError(f"At least one non-empty group needs a ratio > 0. Found ratios {ratio_tensor.tolist()}.")
    weights = mass / mass.sum()
    return (weights.unsqueeze(1) * means).sum(0)


def optimal_ratio(*, client_variance: float, noise_variance: float, reference_noise_variance: float = 0.0) -> float:
    """r* = (σ_c² + v_ref) / (σ_c² + v): FedHDP Lemma 1, r* = (α²+τ²)/(α²+τ²+(1−ρ_np)Nγ²).

    σ_c² = α² + τ² is the variance of a silo's own estimate around the global parameter (data noise
    plus heterogeneity), v the DP-noise variance of one silo's update in the noisier group (Lemma 1:
    (1−ρ_np)Nγ²) and v_ref that of one silo of the reference group (Lemma 1: 0, non-private). All
    per coordinate, or all summed over coordinates: only their ratios matter. With v_ref > 0 this is
    the same inverse-variance weighting that Lemma 1 rests on (Mahdavifar et al. 2017, Lemma 11, as
    cited in §3.1.2; Appendix A's two private levels), since the silos' errors are independent.
    """
    sc = check_non_negative(client_variance, name="client_variance")
    v = check_non_negative(noise_variance, name="noise_variance")
    v_ref = check_non_negative(reference_noise_variance, name="reference_noise_variance")
    if sc + v == 0.0:
        raise ValueError("client_variance + noise_variance must be > 0 for the ratio to be defined. Found 0.")
    return (sc + v_ref) / (sc + v)


def estimate_noise_variance_from_norms(
    norms: torch.Tensor, groups: torch.Tensor, *, dimension: int, n_groups: int | None = None
) -> torch.Tensor:
    """[G]: each group's per-coordinate DP-noise variance in excess of group 0's, from norms alone.

    Model (FedHDP §3.1, eq. (5)–(8), per coordinate): u_i = s + h_i + l_i with a shared signal s,
    a silo deviation h_i of variance σ_c² and DP noise l_i of variance γ_g² in silo i's group g, all
    independent, so E‖u_i‖² = ‖s‖² + d(σ_c² + γ_g²). The estimator is

        γ̂_g² − γ̂_0² = (mean_{i∈g} ‖u_i‖² − mean_{i∈0} ‖u_i‖²) / d,  clamped at 0,

    unbiased for γ_g² − γ_0² (before the clamp). Norms identify only this difference: ‖s‖² + dσ_c² +
    dγ_0² is one unknown. It is the absolute γ_g² when group 0 adds no noise (FedHDP's
    non-private silos). An empty group gives 0.
    """
    if isinstance(dimension, bool) or not isinstance(dimension, int) or dimension < 1:
        raise ValueError(f"dimension must be an integer >= 1. Found {dimension!r}.")
    if not isinstance(norms, torch.Tensor) or norms.dim() != 1 or not norms.is_floating_point():
        raise ValueError(f"norms must be a 1-D floating tensor. Found {getattr(norms, 'dtype', type(norms))}.")
    if not bool(torch.isfinite(norms).all()) or bool((norms < 0).any()):
        raise ValueError("norms must be finite and >= 0 (L2 norms).")
    squared, counts = group_means((norms.to(torch.float64) ** 2).unsqueeze(1), groups, n_groups=n_groups)
    if float(counts[0]) == 0.0:
        raise ValueError("Group 0 (the reference, least noisy group) must hold at least one silo. Found none.")
    excess = (squared[:, 0] - squared[0, 0]).clamp(min=0.0) / dimension
    return torch.where(counts > 0, excess, torch.zeros_like(excess))


def _per_coordinate_variances(updates: torch.Tensor, groups: torch.Tensor, n_groups: int | None) -> torch.Tensor:
    """[G]: V̂_g, the per-coordinate variance σ_c² + γ_g² of one silo's update in group g (nan for an
    empty group); see `budget_blind_ratio` for the estimator."""
    wide = updates.to(torch.float64)
    d = wide.shape[1]
    means, counts = group_means(wide, groups, n_groups=n_groups)
    counts64 = counts.cpu()
    index = groups.to(device=wide.device, dtype=torch.int64)
    # Σ_{i∈g} ‖u_i − ū_g‖², which equals Σ‖u_i‖² − N_g‖ū_g‖² (the silos' norms and the norm of the
    # group mean) but without the cancellation of two large numbers when the shared signal is large.
    spread = torch.linalg.vector_norm(wide - means[index], dim=1) ** 2
    within = torch.zeros(means.shape[0], dtype=torch.float64, device=wide.device).index_add_(0, index, spread).cpu()
    variances = torch.full((means.shape[0],), math.nan, dtype=torch.float64)
    reference: int | None = None
    for g, n in enumerate(counts64.tolist()):
        if n >= 2:
            # Unbiased for V_g, and free of the shared signal.
            variances[g] = float(within[g]) / ((n - 1) * d)
            if reference is None:
                # The least noisy group with two silos (groups are numbered by increasing noise):
                # its mean is the most precise estimate of the shared signal.
                reference = g
    if reference is None:
        raise ValueError(
            "At least one group needs 2 or more silos to tell the shared signal from the variance. "
            f"Found group sizes {counts64.to(torch.int64).tolist()}."
        )
    reference_mean = means[reference]
    reference_spread = float(variances[reference]) / float(counts64[reference])
    labels = groups.cpu().to(torch.int64)
    for g, n in enumerate(counts64.tolist()):
        if n == 1:
            # A lone silo: E‖u − ū_h‖² = d·(V_g + V_h/N_h), since ū_h estimates s independently of u.
            distance = float(torch.linalg.vector_norm(wide[int(torch.nonzero(labels == g)[0])] - reference_mean) ** 2)
            variances[g] = max(distance / d - reference_spread, 0.0)
    return variances


def budget_blind_ratio(updates: torch.Tensor, groups: torch.Tensor, *, n_groups: int | None = None) -> torch.Tensor:
    """[G]: r_g for `fedhdp_aggregate`, estimated from the updates without any budget (r_0 = 1).

    Lemma 1 weighs each silo by the inverse variance of its update around the global parameter, so
    r_g = V_0 / V_g with V_g = σ_c² + γ_g² per coordinate (`optimal_ratio`: (σ_c² + γ_0²)/(σ_c² + γ_g²)).
    Model as in `estimate_noise_variance_from_norms`: u_i = s + h_i + l_i, E‖u_i‖² = ‖s‖² + d·V_g.
    Estimator of V_g:
    - a group of N_g ≥ 2 silos: V̂_g = (Σ_{i∈g} ‖u_i‖² − N_g‖ū_g‖²) / ((N_g − 1)·d), its unbiased
      within-group variance: the silos' norms and the norm of the group mean. Unlike differences of
      mean squared norms (`estimate_noise_variance_from_norms`) it has no cross term 2sᵀ(h_i + l_i),
      so it stays precise when the shared signal is large.
    - a lone silo: V̂_g = ‖u_i − ū_h‖²/d − V̂_h/N_h, its squared distance to the mean of the least
      noisy group h with at least 2 silos (an independent estimate of s), less that mean's own
      variance: unbiased, and again free of the 2sᵀ(h_i + l_i) term that makes ‖u_i‖²/d − ‖s‖²/d
      imprecise for one silo. A lone least-noisy silo is the common case for MixGauss1 budgets over
      10 silos (Liu et al. 2023 Table 1: weight 0.1 at ε ≈ 10).
    Variances are clamped at 0; r_g = V̂_0/V̂_g (1 where both are 0, 0 for an empty group, and
    possibly above 1 where a noisier-looking group turns out less variable). Needs at least one
    group with 2 silos and a non-empty group 0.
    """
    check_updates(updates)
    variances = _per_coordinate_variances(updates, groups, n_groups)
    reference = float(variances[0])
    if math.isnan(reference):
        raise ValueError("Group 0 (the least noisy) must hold at least one silo. Found none.")
    ratios = []
    for v in variances.tolist():
        if math.isnan(v):
            ratios.append(0.0)
        elif v == 0.0:
            ratios.append(1.0 if reference == 0.0 else math.inf)
        else:
            ratios.append(reference / v)
    if any(math.isinf(r) for r in ratios):
        raise ValueError(f"A group's estimated variance is 0 while group 0's is {reference}: no finite ratio.")
    return torch.tensor(ratios, dtype=torch.float64)
