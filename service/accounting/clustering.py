"""Privacy groups from the L2 norms of noisy updates, never from budgets (Liu et al. 2023 §4.1, Alg. 1 line 4).

Silos whose budgets are close add Gaussian noise of similar scale, so the norms of their noisy
updates fall into clusters ordered by noise level (Liu et al. 2023 §3.2, Fig. 2). The coordinator fits a
1-D Gaussian mixture to the (log) norms of the warm-start round, picks the number of components by
BIC, and reads the privacy groups off it; budgets stay secret. Clustering already-private outputs is
post-processing and costs no budget
(Liu et al. 2023 §4.1, "Privacy Analysis").

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
# The mixture is fitted to log-norms. The DP noise in an update is σ·C·(a χ-distributed norm), so a
# group's norms spread in proportion to their level: additive in log space, and a variance floor
# there is a floor on *relative* spread, independent of the norms' unit. Without a floor, a single
# norm or a pair of nearly equal ones makes an almost-zero-variance component whose unbounded
# likelihood beats the BIC penalty (the degeneracy of Gaussian-mixture maximum likelihood), and
# 10 silos then split into spurious groups. Budgets within one privacy group spread by ~10% of
# their mean (Liu et al. 2023 Table 1: N(0.1, 0.01), N(1, 0.1), N(10, 1)) and noise scales with ~1/ε,
# so a component narrower than a 5% relative spread is fitting sampling noise, not a group.
# Measured on the warm-start round of tests/service/accounting/test_clustering.py (20 seeds × 10
# silos, share of silos in their budget group for MixGauss1/2/3): raw norms with sklearn's default
# absolute floor 87.5/86.5/53.5%; log-norms with a 1e-3 floor 87/84.5/95%; log-norms with this
# floor 99/100/100%, and ≥ 99% for every floor from 0.03 to 0.1.
LOG_STD_FLOOR = 0.05
# EM restarts per candidate number of components, each from k-means++ seeds: a bad local optimum on
# 10 points is common, and with a fixed random_state the restarts keep the result deterministic.
# k-means++ seeding rather than full k-means: the same groups on the warm-start check above, at
# half the cost (sklearn's Lloyd iterations dominate on a handful of points).
N_INIT = 5
MAX_ITER = 500


@dataclass(frozen=True)
class Component:
    """One privacy group: the mean and population standard deviation of its silos' norms (in the
    norms' own unit), and how many silos it holds."""

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


def _fit(centred_logs: np.ndarray, *, n_components: int, seed: int) -> GaussianMixture:
    mixture = GaussianMixture(
        n_components=n_components,
        covariance_type="full",
        # Added to every component's variance: the relative-spread floor (see LOG_STD_FLOOR).
        reg_covar=LOG_STD_FLOOR**2,
        n_init=N_INIT,
        max_iter=MAX_ITER,
        init_params="k-means++",
        random_state=seed,
    )
    with warnings.catch_warnings():
        # A non-converged fit is still a valid candidate; BIC judges it like any other.
        warnings.simplefilter("ignore", ConvergenceWarning)
        mixture.fit(centred_logs)
    return mixture


def _log_norms(values: np.ndarray) -> np.ndarray:
    """log of the norms, with a zero norm (an update with no noise at all) mapped just below the
    smallest positive norm's log, so that it lands in the least noisy group instead of at -inf."""
    positive = values[values > 0.0]
    floor = float(positive.min()) * math.exp(-1.0) if len(positive) else 1.0
    logs: np.ndarray = np.log(np.maximum(values, floor))
    return logs


def cluster_norms(norms: Mapping[int, float], *, seed: int = 0, max_components: int = 3) -> Grouping:
    """Group silos by the L2 norms of their noisy updates (Liu et al. 2023 §4.1, Alg. 1 line 4).

    A Gaussian mixture with 1..max_components components is fitted to the log-norms; the number of
    components with the lowest BIC wins (ties go to fewer components). Never more components than
    distinct norms; fewer than 3 reports give one group. Each silo goes to its most probable
    component; a component that then holds no silo is dropped, and groups are numbered by
    increasing mean norm, so group 0 is the least noisy. `Component.mean_norm` / `std_norm` are the
    mean and (population) standard deviation of the norms in the group.

    Deterministic: the result depends only on the multiset of norms (and `seed`, `max_components`),
    not on the order of the mapping, the silo ids, or the unit of the norms.
    """
    if isinstance(max_components, bool) or not isinstance(max_components, int) or max_components < 1:
        raise ValueError(f"max_components must be an integer >= 1. Found {max_components!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32). Found {seed!r}.")
    silo_ids, values = _validated(norms)
    n_distinct = len(np.unique(values))
    if len(values) < MIN_REPORTS_TO_CLUSTER or n_distinct == 1 or max_components == 1:
        return _one_group(silo_ids, values)

    # Fit on the sorted values so that neither the mapping's order nor the silo ids can change the
    # k-means initialisation: only the norms decide the grouping. Centring the logs makes the fit
    # see the same numbers whatever the unit of the norms.
    order = np.argsort(values, kind="stable")
    logs = _log_norms(values[order])
    centred = (logs - logs.mean()).reshape(-1, 1)

    best = _fit(centred, n_components=1, seed=seed)
    best_bic = float(best.bic(centred))
    for k in range(2, min(max_components, n_distinct) + 1):
        candidate = _fit(centred, n_components=k, seed=seed)
        bic = float(candidate.bic(centred))
        # Strictly lower: a tie keeps the simpler model.
        if bic < best_bic:
            best, best_bic = candidate, bic

    labels = np.empty(len(values), dtype=np.int64)
    labels[order] = best.predict(centred)
    fitted_means = best.means_.reshape(-1)
    occupied = sorted(
        {int(label) for label in labels},
        key=lambda c: (float(values[labels == c].mean()), float(fitted_means[c])),
    )
    renumber = {component: group for group, component in enumerate(occupied)}
    components = [
        Component(
            mean_norm=float(values[labels == c].mean()),
            std_norm=float(values[labels == c].std()),
            size=int(np.count_nonzero(labels == c)),
        )
        for c in occupied
    ]
    groups = {silo_id: renumber[int(label)] for silo_id, label in zip(silo_ids, labels, strict=True)}
    return Grouping(groups=groups, components=components)
