"""The random number of trials K of a private hyperparameter search (Papernot & Steinke 2022).

The accounting of `repeat_and_select` (dp-accounting's `RepeatAndSelectDpEvent`) holds only if K
really is drawn from the distribution it assumes, so the service draws K itself (docs/ARCHITECTURE.md,
"Hyperparameter searches"; Liu et al. 2022 §7). The distributions and their mean → parameter mapping
are dp-accounting's, read from `_compute_rdp_repeat_and_select`:

- "poisson" (shape = ∞): P[K = k] = e^{-μ} μ^k / k!, k ≥ 0 (Papernot & Steinke, Thm 6; K = 0 is
  possible and releases nothing).
- truncated negative binomial with shape η > 0 (Papernot & Steinke, Def. 1): for k ≥ 1,
  P[K = k] = (1 − γ)^k / (γ^{−η} − 1) · Π_{ℓ=0}^{k−1} (ℓ + η)/(ℓ + 1); η = 1 is the geometric
  P[K = k] = γ(1 − γ)^{k−1}.
- logarithmic (η = 0, the η → 0 limit): P[K = k] = (1 − γ)^k / (k · ln(1/γ)), k ≥ 1.

γ comes from the mean through dp-accounting's own `_gamma_truncated_negative_binomial` (a bisection
that returns the conservative end), so the K drawn here and the ε charged use the same γ bit for bit.

Sampling is by inversion of the CDF, walking the pmf with its ratio P[k+1]/P[k]; the number of
steps is K itself, so the expected work is the mean. The uniform comes from `secrets.SystemRandom`
by default: a predictable K would let whoever runs the search know when it stops.
"""

from __future__ import annotations

import functools
import math
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.wire.searches import DistributionKind

Shape = float | Literal["infinity"]
KINDS: tuple[DistributionKind, ...] = ("poisson", "geometric", "logarithmic", "truncated_negative_binomial")

# e^{-μ} must stay a normal float for the Poisson walk to start (e^{-700} ≈ 1e-304); a search of
# more than a few hundred trials on average is not a hyperparameter search anyway.
MAX_MEAN_TRIALS = 500.0

_SYSTEM_RANDOM = secrets.SystemRandom()


@dataclass(frozen=True)
class TrialDistribution:
    """K's law: `kind`, its `shape` as RepeatAndSelect stores it, and its mean."""

    kind: DistributionKind
    shape: Shape
    mean: float

    @property
    def shape_value(self) -> float:
        return math.inf if self.shape == "infinity" else float(self.shape)

    @functools.cached_property  # a bisection: computed once, not at every step of the walk
    def gamma(self) -> float | None:
        """The halting probability γ of the truncated negative binomial (None for Poisson)."""
        if self.shape == "infinity":
            return None
        # dp-accounting's private helper on purpose: the charge is computed with exactly this γ.
        return float(rdp_lib._gamma_truncated_negative_binomial(float(self.shape), self.mean))

    def first(self) -> tuple[int, float]:
        """(smallest k with positive mass, its probability)."""
        if self.shape == "infinity":
            return 0, math.exp(-self.mean)
        gamma, eta = self.gamma, float(self.shape)
        assert gamma is not None
        if gamma >= 1.0:  # mean = 1: K = 1 surely
            return 1, 1.0
        if eta == 0.0:
            return 1, (1.0 - gamma) / math.log(1.0 / gamma)
        # η(1 − γ)/(γ^{−η} − 1), with expm1 so that a tiny η·ln(1/γ) keeps its precision.
        return 1, eta * (1.0 - gamma) / math.expm1(-eta * math.log(gamma))

    def ratio(self, k: int) -> float:
        """P[K = k + 1] / P[K = k]."""
        if self.shape == "infinity":
            return self.mean / (k + 1)
        gamma = self.gamma
        assert gamma is not None
        return (1.0 - gamma) * (k + float(self.shape)) / (k + 1)

    def pmf(self, k: int) -> float:
        """P[K = k] (exact up to float rounding; used by tests and by nothing that charges)."""
        start, p = self.first()
        if k < start:
            return 0.0
        gamma = self.gamma
        if gamma is not None and gamma >= 1.0:
            return 1.0 if k == 1 else 0.0
        for j in range(start, k):
            p *= self.ratio(j)
        return p


def distribution(kind: DistributionKind, *, mean: float, shape: float | None = None) -> TrialDistribution:
    """kind → RepeatAndSelect shape: poisson → "infinity", geometric → 1, logarithmic → 0,
    truncated_negative_binomial → η (required, 0 < η < ∞)."""
    if not (math.isfinite(mean) and 1.0 <= mean <= MAX_MEAN_TRIALS):
        raise ValueError(f"mean must be in [1, {MAX_MEAN_TRIALS:g}]. Found {mean}.")
    if kind == "truncated_negative_binomial":
        if shape is None or not (math.isfinite(shape) and shape > 0):
            raise ValueError(f"truncated_negative_binomial needs a finite shape η > 0. Found {shape}.")
        return TrialDistribution(kind, float(shape), mean)
    if shape is not None:
        raise ValueError(f"shape is fixed by kind {kind!r}; give it only for truncated_negative_binomial. Found {shape}.")
    fixed: dict[str, Shape] = {"poisson": "infinity", "geometric": 1.0, "logarithmic": 0.0}
    if kind not in fixed:
        raise ValueError(f"kind must be one of {KINDS}. Found {kind!r}.")
    return TrialDistribution(kind, fixed[kind], mean)


def draw_trials(law: TrialDistribution, *, rng: random.Random | None = None) -> int:
    """One draw of K by CDF inversion; `rng` is injectable for tests, cryptographic by default."""
    uniform: Callable[[], float] = (rng or _SYSTEM_RANDOM).random
    u = uniform()
    k, p = law.first()
    cdf = p
    while u >= cdf:
        p *= law.ratio(k)
        k += 1
        if p == 0.0:
            # Rounding left the summed CDF a hair below 1 and the pmf has underflowed: the walk is
            # past every value with representable mass, so stop at the last one.
            break
        cdf += p
    return k
