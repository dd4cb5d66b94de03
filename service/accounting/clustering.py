"""Privacy groups from the L2 norms of noisy updates, never from budgets (paper 001 §4.1, Alg. 1 line 4).

Silos whose budgets are close add Gaussian noise of similar scale, so the norms of their noisy
updates fall into clusters ordered by noise level (paper 001 §3.2, Fig. 2). The coordinator fits a
1-D Gaussian mixture to the norms of the warm-start round and reads the privacy groups off it;
budgets stay secret. Clustering already-private outputs is post-processing and costs no budget
(paper 001 §4.1, "Privacy Analysis").

Pure: numpy and scikit-learn only, no database, no HTTP, no torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import GaussianMixture

# Below this many reports a mixture is not identifiable (each extra 1-D component has 3 free
# parameters), so every silo is put in one group.
MIN_REPORTS_TO_CLUSTER = 3
# The norms are standardised before fitting, so this floor on a component's variance is relative to
# the spread of all norms: a component cannot shrink below 1e-3 of that spread in standard
# deviation. Without a floor a pair of nearly equal norms makes an almost-zero-variance component
# whose unbounded likelihood beats the BIC penalty (the degeneracy of Gaussian-mixture maximum
# likelihood); with sklearn's absolute default, the outcome would depend on the unit of the norms.
RELATIVE_VARIANCE_FLOOR = 1e-6
# EM restarts per candidate number of components: a bad local optimum on 10 points is common,
# and with a fixed random_state the restarts keep the result deterministic.
N_INIT = 5
MAX_ITER = 500


@dataclass(frozen=True)
class Component:
    """One fitted mixture component, in the units of the norms. `size` is how many silos it holds."""

    mean_norm: float
    std_norm: float
    size: int


@dataclass(frozen=True)
class Grouping:
    """Silo id → privacy group. Group 0 has the smallest mean norm (the least noisy silos), and
    `components[g]` describes group g."""

    groups: dict[int, int]
    components: list[Component]

    @property
    def n_components(self) -> int:
        return len(self.components)


def _validated(norms: Mapping[int, float]) -> tuple[list[int], np.ndarray]:
    if len(norms) == 0:
        raise ValueError("norms must hold at least one silo's report. Found none.")
    silo_ids: list[int] = []
    values: list[float] = []
    for silo_id, norm in norms.items():
        if isinstance(silo_id, bool) or not isinstance(silo_id, int | np.integer):
            raise ValueError(f"Silo ids must be integers. Found {silo_id!r}.")
        if isinstance(norm, bool) or not isinstance(norm, int | float | np.integer | np.floating):
            raise ValueError(f"Norm of silo {silo_id} must be a number. Found {norm!r}.")
        value = float(norm)
        if not math.isfinite(value):
            raise ValueError(f"Norm of silo {silo_id} must be finite. Found {value}.")
        if value < 0.0:
            raise ValueError(f"Norm of silo {silo_id} must be >= 0 (an L2 norm). Found {value}.")
        silo_ids.append(int(silo_id))
        values.append(value)
    return silo_ids, np.asarray(values, dtype=np.float64)


def _one_group(silo_ids: list[int], values: np.ndarray) -> Grouping:
    return Grouping(
        groups={silo_id: 0 for silo_id in silo_ids},
        components=[Component(mean_norm=float(values.mean()), std_norm=float(values.std()), size=len(values))],
    )


def _fit(standardised: np.ndarray, *, n_components: int, seed: int) -> GaussianMixture:
    mixture = GaussianMixture(
        n_components=n_components,
        covariance_type="full",
        reg_covar=RELATIVE_VARIANCE_FLOOR,
        n_init=N_INIT,
        max_iter=MAX_ITER,
        init_params="kmeans",
        random_state=seed,
    )
    with warnings.catch_warnings():
        # A non-converged fit is still a valid candidate; BIC judges it like any other.
        warnings.simplefilter("ignore", ConvergenceWarning)
        mixture.fit(standardised)
    return mixture


def cluster_norms(norms: Mapping[int, float], *, seed: int = 0, max_components: int = 3) -> Grouping:
    """Group silos by the norms of their noisy updates (paper 001 §4.1, Alg. 1 line 4).

    A Gaussian mixture with 1..max_components components is fitted to the 1-D norms; the number of
    components with the lowest BIC wins (ties go to fewer components). Never more components than
    distinct norms; fewer than 3 reports give one group. Groups are renumbered by increasing fitted
    mean, so group 0 is the least noisy; a component that ends up holding no silo is dropped.
    `Component.mean_norm` / `std_norm` are the fitted parameters in the units of the norms.

    Deterministic: the result depends only on the multiset of norms (and `seed`, `max_components`),
    not on the order of the mapping, the silo ids, or their unit of measure.
    """
    if isinstance(max_components, bool) or not isinstance(max_components, int) or max_components < 1:
        raise ValueError(f"max_components must be an integer >= 1. Found {max_components!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32). Found {seed!r}.")
    silo_ids, values = _validated(norms)
    n_distinct = len(np.unique(values))
    if len(values) < MIN_REPORTS_TO_CLUSTER or n_distinct == 1 or max_components == 1:
        return _one_group(silo_ids, values)

    # Fit on the sorted norms so that neither the mapping's order nor the silo ids can change the
    # k-means initialisation: only the norms decide the grouping.
    order = np.argsort(values, kind="stable")
    location, scale = float(values.mean()), float(values.std())
    standardised = ((values[order] - location) / scale).reshape(-1, 1)

    best = _fit(standardised, n_components=1, seed=seed)
    best_bic = float(best.bic(standardised))
    for k in range(2, min(max_components, n_distinct) + 1):
        candidate = _fit(standardised, n_components=k, seed=seed)
        bic = float(candidate.bic(standardised))
        # Strictly lower: a tie keeps the simpler model.
        if bic < best_bic:
            best, best_bic = candidate, bic

    labels_sorted = best.predict(standardised)
    labels = np.empty_like(labels_sorted)
    labels[order] = labels_sorted
    means = best.means_.reshape(-1)
    stds = np.sqrt(best.covariances_.reshape(-1))
    occupied = sorted({int(label) for label in labels}, key=lambda c: (means[c], c))
    renumber = {component: group for group, component in enumerate(occupied)}
    components = [
        Component(
            mean_norm=location + scale * float(means[c]),
            std_norm=scale * float(stds[c]),
            size=int(np.count_nonzero(labels == c)),
        )
        for c in occupied
    ]
    groups = {silo_id: renumber[int(label)] for silo_id, label in zip(silo_ids, labels, strict=True)}
    return Grouping(groups=groups, components=components)
