"""Server-side aggregation over stacked silo updates [K, P]: pure torch functions, no state.

- `pfa_aggregate`: projected federated averaging (Liu et al. 2023 Alg. 1).
- `fedhdp_aggregate`, `optimal_ratio`, `estimate_noise_variance_from_norms`, `budget_blind_ratio`:
  FedHDP's two-step aggregation and its ratio r (FedHDP §3.1.2, Lemma 1, Alg. 2).
- `noisy_quantile_clip_update`: adaptive clipping by a noisy quantile query (FedHDP Alg. 2;
  Andrew et al. 2021), returning the mechanism that query ran.

Aggregating already-private updates is post-processing (docs/ARCHITECTURE.md, "The privacy model"); only the
quantile query is a mechanism, and it returns what it must be charged as. (PMTL's noisy global
learner, "Private Multi-Task Learning" Alg. 1, lives in the repository's research/ folder: no
algorithm runs it.)
"""

from dpledger.trainer.aggregation.clipping import (
    QuantileClipUpdate,
    clip_updates,
    noisy_quantile_clip_update,
)
from dpledger.trainer.aggregation.fedhdp import (
    budget_blind_ratio,
    estimate_noise_variance_from_norms,
    fedhdp_aggregate,
    group_means,
    optimal_ratio,
)
from dpledger.trainer.aggregation.pfa import (
    pfa_aggregate,
    project_onto,
    public_mask,
    top_k_subspace,
)

__all__ = [
    "QuantileClipUpdate",
    "budget_blind_ratio",
    "clip_updates",
    "estimate_noise_variance_from_norms",
    "fedhdp_aggregate",
    "group_means",
    "noisy_quantile_clip_update",
    "optimal_ratio",
    "pfa_aggregate",
    "project_onto",
    "public_mask",
    "top_k_subspace",
]
