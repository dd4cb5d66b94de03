"""Per-silo privacy budgets ε drawn from Liu et al. 2023 Table 1's Gaussian mixtures MixGauss1–3.

The mixture component a silo's ε came from is its "budget-based privacy group" (Liu et al. 2023 §4.1):
the ground truth that clustering the norms of noisy updates should recover. It is for evaluation
only; the coordinator must never be given it (Liu et al. 2023: budgets are not exposed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

import numpy as np

MixtureName = Literal["MixGauss1", "MixGauss2", "MixGauss3"]


@dataclass(frozen=True)
class MixtureComponent:
    weight: float
    mean: float
    std: float


# Liu et al. 2023 Table 1 ("Distribution of clients' privacy budgets"). The table writes N(a, b); b is
# read as the standard deviation (the scale passed to a normal sampler), as in the brief.
MIXGAUSS_TABLE: Final[Mapping[str, tuple[MixtureComponent, ...]]] = MappingProxyType(
    {
        "MixGauss1": (
            MixtureComponent(weight=0.9, mean=0.1, std=0.01),
            MixtureComponent(weight=0.1, mean=10.0, std=0.1),
        ),
        "MixGauss2": (
            MixtureComponent(weight=0.9, mean=1.0, std=0.1),
            MixtureComponent(weight=0.1, mean=10.0, std=0.1),
        ),
        "MixGauss3": (
            MixtureComponent(weight=0.5, mean=0.1, std=0.01),
            MixtureComponent(weight=0.4, mean=1.0, std=0.1),
            MixtureComponent(weight=0.1, mean=10.0, std=1.0),
        ),
    }
)

# A Gaussian draw can be ≤ 0, which is no privacy budget at all; such a draw is clipped up to this
# (it would take a 10-standard-deviation draw under Table 1, so it essentially never happens).
DEFAULT_MIN_EPSILON = 1e-3


@dataclass(frozen=True)
class BudgetDraw:
    """ε_k for each silo k, and the index of the Table 1 component it was drawn from."""

    mixture: str
    epsilons: np.ndarray
    components: np.ndarray


def draw_budgets(
    mixture: MixtureName, *, n_silos: int, seed: int, min_epsilon: float = DEFAULT_MIN_EPSILON
) -> BudgetDraw:
    """Draw `n_silos` budgets i.i.d. from the named mixture: a component by its weight, then
    ε ~ N(mean, std²) of that component, clipped below at `min_epsilon`. Deterministic from `seed`."""
    if mixture not in MIXGAUSS_TABLE:
        raise ValueError(f"mixture must be one of {sorted(MIXGAUSS_TABLE)}. Found {mixture!r}.")
    if n_silos < 1:
        raise ValueError(f"n_silos must be at least 1. Found {n_silos}.")
    if not (math.isfinite(min_epsilon) and min_epsilon > 0.0):
        raise ValueError(f"min_epsilon must be a finite number > 0. Found {min_epsilon}.")
    table = MIXGAUSS_TABLE[mixture]
    weights = np.array([c.weight for c in table])
    means = np.array([c.mean for c in table])
    stds = np.array([c.std for c in table])
    rng = np.random.default_rng(seed)
    components = rng.choice(len(table), size=n_silos, p=weights / weights.sum())
    epsilons = np.maximum(means[components] + stds[components] * rng.standard_normal(n_silos), min_epsilon)
    components = components.astype(np.int64)
    # Read-only so a shared draw cannot be edited by one consumer behind another's back.
    epsilons.flags.writeable = False
    components.flags.writeable = False
    return BudgetDraw(mixture=mixture, epsilons=epsilons, components=components)
