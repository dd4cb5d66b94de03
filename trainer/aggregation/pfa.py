"""Projected federated averaging (PFA; Liu et al. 2023 Alg. 1, lines 14–19, after Liu et al. VLDB 2021).

The "public" silos (the least noisy privacy group found by `cluster_norms`) span a low-dimensional
subspace that holds most of the signal; the mean update of the "private" silos is projected onto it,
which discards the part of their heavy DP noise that lies outside it. Everything here operates on
already-private updates, so it is post-processing and costs no budget (Liu et al. 2023 §4.1).
"""

from __future__ import annotations

import torch

from dpledger.trainer.aggregation._checks import check_mask, check_updates


def public_mask(groups: torch.Tensor, *, n_public_groups: int = 1) -> torch.Tensor:
    """bool [K]: the silos in the `n_public_groups` least noisy groups (group ids from
    `cluster_norms`, where group 0 is the least noisy) form PFA's S_pub (Liu et al. 2023 Alg. 1 line 4)."""
    if isinstance(n_public_groups, bool) or not isinstance(n_public_groups, int) or n_public_groups < 1:
        raise ValueError(f"n_public_groups must be an integer >= 1. Found {n_public_groups!r}.")
    if not isinstance(groups, torch.Tensor) or groups.dim() != 1 or groups.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"groups must be a 1-D integer tensor. Found {getattr(groups, 'dtype', type(groups))}.")
    return groups < n_public_groups


def top_k_subspace(updates: torch.Tensor, *, k: int) -> torch.Tensor:
    """[P, k] orthonormal columns: the top-k eigenvectors of the second-moment matrix
    (1/n)·Σ_m Δx_m Δx_mᵀ of the given updates (Liu et al. 2023 Alg. 1 line 15).

    They are the top-k right singular vectors of the stacked [n, P] updates, so the SVD of that
    small matrix replaces the eigendecomposition of a P×P matrix (P is the model size, n ≤ a few
    dozen silos). The sign of each vector is arbitrary; only the subspace V_k V_kᵀ is used.
    """
    check_updates(updates)
    n, p = updates.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(n, p):
        raise ValueError(
            f"k must be an integer in [1, min(number of updates, dimension)] = [1, {min(n, p)}]. Found {k!r}."
        )
    vh: torch.Tensor = torch.linalg.svd(updates, full_matrices=False).Vh
    return vh[:k].T.contiguous()


def project_onto(vector: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """V Vᵀ x: the orthogonal projection of `vector` [P] onto the span of `basis` [P, k]'s
    orthonormal columns (Liu et al. 2023 Alg. 1 line 16)."""
    if vector.dim() != 1 or basis.dim() != 2 or basis.shape[0] != vector.shape[0]:
        raise ValueError(
            f"vector must be [P] and basis [P, k] with the same P. Found {tuple(vector.shape)} and {tuple(basis.shape)}."
        )
    return basis @ (basis.T @ vector)


def pfa_aggregate(updates: torch.Tensor, public: torch.Tensor, *, k: int) -> torch.Tensor:
    """Δx̄ = (|S_pub|/|S|)·Δx̄_pub + (|S_pri|/|S|)·V_k V_kᵀ Δx̄_pri (Liu et al. 2023 Alg. 1, lines 15–18).

    `updates` [K, P] are the silos' noisy updates; `public` (bool [K]) marks S_pub, whose updates
    both give the subspace V_k (top-k, `top_k_subspace`) and enter the average unprojected. With no
    private silo this is the plain mean of the public ones. Returns the aggregate update [P].
    """
    check_updates(updates)
    check_mask(public, n=updates.shape[0], name="public")
    n_public = int(public.sum())
    n_private = updates.shape[0] - n_public
    if n_public == 0:
        raise ValueError("public must mark at least one silo: PFA needs public updates to find the subspace. Found none.")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(n_public, updates.shape[1]):
        raise ValueError(
            f"k must be an integer in [1, min(public silos, dimension)] = [1, {min(n_public, updates.shape[1])}]. "
            f"Found {k!r}."
        )
    public_mean = updates[public].mean(0)
    if n_private == 0:
        return public_mean
    basis = top_k_subspace(updates[public], k=k)
    projected_private_mean = project_onto(updates[~public].mean(0), basis)
    total = n_public + n_private
    return (n_public / total) * public_mean + (n_private / total) * projected_private_mean
