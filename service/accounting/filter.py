"""The proven budget gate: a union bound over Rényi filters at orders fixed before the first charge.

Feldman & Zrnic ("Individual Privacy Accounting via a Rényi Filter", NeurIPS 2021, Theorem 3.1):
at a fixed order α, an interaction whose per-step RDP bounds ρ_t are chosen adaptively and halted
before Σρ_t exceeds B is (α, B)-RDP. A silo's filter fixes orders α_1..α_m and weights w_i (Σw_i =
1) before its first charge, and the gate approves a step while SOME i still has
ε_i = conv(α_i, Σρ_t(α_i); δ·w_i) ≤ ε. Why that is (ε, δ)-DP: write F_i for the filter at α_i
with budget B_i = the largest RDP that converts to ε at δ·w_i. Every transcript ends with some F_i
never exceeded (the last approval left one alive and sums only grow); on the transcripts where F_i
stayed alive, the interaction coincides with the one halted by F_i, which is (α_i, B_i)-RDP and so
has hockey-stick divergence at most δ·w_i at e^ε (dp-accounting's conversion, Canonne, Kamath &
Steinke 2020). Splitting E_P[(1 − e^{ε−L})_+] over those transcripts gives at most Σ δ·w_i = δ.

Today's rule (some order of 156, each with the whole δ, chosen when checking) is that union bound
without the split, and a two-step randomized-response interaction shows it false (README).
Everything here is O(number of filter orders): the running sum is already kept per order.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import rdp
from dpledger.wire.mechanisms import DpSgd

COMMITTED_WEIGHT = 0.9
# The other 0.1 is spread over every other order of the grid. Nearby orders alone are not enough: a
# Poisson-sampled Gaussian's RDP jumps by orders of magnitude within a few orders (q = 0.01, σ = 1:
# 0.04 at α = 10, 0.98 at α = 12), so a workload unlike the horizon (a short job, a small spend) is
# cheapest at an order the horizon never suggests; with only the four orders nearest the committed
# one, one such step read ε = 2.73 where dp-accounting reads 0.96. Over the whole grid the price of a
# workload far from the horizon is at most ln(1550)/(α − 1) above its best order's conversion.
# The default horizon: DP-SGD at a batch of 256 with noise multiplier 1, run until
# it spends the budget. Its best order is where a typical training run's ε is lowest.
HORIZON_BATCH = 256
HORIZON_NOISE = 1.0
# ...but never sampling more than 1% of a small set: q = 256/1000 would commit order 16, where one
# step at q = 0.01 reads 1.77 against its best order's 0.96 (a small silo trains on small batches).
HORIZON_MAX_RATE = 0.01


@dataclass(frozen=True)
class FilterSpec:
    orders: tuple[float, ...]  # each one of rdp.ORDERS
    weights: tuple[float, ...]  # δ shares, summing to at most 1
    source: str  # "horizon" (default or declared), or "legacy" (the orders a pre-filter silo was gated on)

    def __post_init__(self) -> None:
        if len(self.orders) != len(self.weights) or not self.orders:
            raise ValueError("a filter needs one weight per order, and at least one order")
        if any(a not in rdp.ORDERS for a in self.orders):
            raise ValueError("filter orders must be orders of the ledger's grid")
        # Summed exactly (no tolerance): the shares split δ, so a sum past 1 would spend past δ.
        if any(not w > 0 for w in self.weights) or sum(map(Fraction, self.weights)) > 1:
            raise ValueError("filter weights must be positive and sum to at most 1")

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(rdp.ORDERS.index(a) for a in self.orders)

    def to_json(self) -> str:
        return json.dumps({"orders": list(self.orders), "weights": list(self.weights), "source": self.source},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FilterSpec:
        return _parsed(text)


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> FilterSpec:
    # Every approval reads its silo's filter from the row; parsing and validating it once per text.
    data = json.loads(text)
    return FilterSpec(tuple(float(a) for a in data["orders"]), tuple(float(w) for w in data["weights"]), str(data["source"]))


@dataclass(frozen=True)
class Reading:
    epsilon: float  # min_i ε_i: the proven ε of the history so far
    order: float  # the order that gives it


def order_epsilon(*, order: float, rdp_value: float, delta: float) -> float:
    """dp-accounting's RDP → (ε, δ) conversion at one order (the one its compute_epsilon minimises)."""
    if math.isnan(rdp_value) or math.isinf(rdp_value):
        return math.inf
    return float(rdp_lib.compute_epsilon([order], [rdp_value], delta)[0])


def order_epsilons(orders: np.ndarray, rdp_values: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """order_epsilon at many orders at once: the same branches as dp-accounting's compute_epsilon
    (Canonne, Kamath & Steinke 2020, Proposition 12), vectorised because one call per order costs
    ~20 µs of Python and a legacy filter has 156 orders. Checked against it in the tests."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        formula = rdp_values + np.log1p(-1 / orders) - np.log(deltas * orders) / (orders - 1)
        eps = np.where(orders > 1.01, formula, np.inf)
        eps = np.where(deltas**2 + np.expm1(-rdp_values) > 0, 0.0, eps)  # the KL bound: δ ≥ sqrt(1 − e^{−KL})
        eps = np.where(rdp_values < 0, 0.0, eps)
        eps = np.where(np.isfinite(rdp_values), eps, np.inf)
    return np.maximum(eps, 0.0)


def read(spec: FilterSpec, curve: np.ndarray, *, delta: float) -> Reading:
    """The proven ε of a running sum (a curve on rdp.ORDERS) under the silo's filter."""
    orders, weights, indices = _arrays(spec)
    # One ulp down from the rounded product: each δ_i ≤ δ·w_i exactly, so Σδ_i ≤ δ.
    eps = order_epsilons(orders, curve[indices], np.nextafter(delta * weights, 0.0))
    best = int(np.argmin(eps))
    return Reading(float(eps[best]), float(orders[best]))


@functools.lru_cache(maxsize=4096)
def _arrays(spec: FilterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array(spec.orders), np.array(spec.weights), np.array(spec.indices)


def approves(spec: FilterSpec, candidate: np.ndarray, *, delta: float, budget: float) -> tuple[bool, Reading]:
    """Whether the gate approves the step that makes the running sum `candidate`."""
    reading = read(spec, candidate, delta=delta)
    return rdp.within_budget(reading.epsilon, budget=budget), reading


def spread_spec(committed: float, *, source: str) -> FilterSpec:
    """COMMITTED_WEIGHT on `committed`, the rest split evenly over every other order of the grid."""
    others = tuple(a for a in rdp.ORDERS if a != committed)
    # Rounded down, so that the float shares never sum past 1.
    share = math.nextafter((1 - COMMITTED_WEIGHT) / len(others), 0.0)
    return FilterSpec((committed, *others), (COMMITTED_WEIGHT, *([share] * len(others))), source)


def committed_order(horizon: np.ndarray, *, epsilon: float, delta: float) -> float:
    """The order at which `horizon` scaled to spend exactly ε at δ has its lowest ε.

    Scaling a curve by m is running its workload m times; bisection on m in log space finds the m
    whose ε is the budget (a finite, positive curve's ε grows with m)."""
    finite = np.isfinite(horizon) & (horizon > 0)
    if not finite.any():
        raise ValueError("the horizon's RDP curve is infinite or zero at every order")
    curve = np.where(finite, horizon, np.inf)
    lo, hi = 1e-9, 1e12
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if rdp.epsilon(curve * mid, delta=delta)[0] > epsilon:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-9:
            break
    _, order = rdp.epsilon(curve * lo, delta=delta)
    return float(order)


def default_horizon(dataset_size: int) -> DpSgd:
    return DpSgd(noise_multiplier=HORIZON_NOISE, steps=1, sampling_rate=min(HORIZON_MAX_RATE, HORIZON_BATCH / dataset_size))


def horizon_spec(*, epsilon: float, delta: float, horizon: np.ndarray) -> FilterSpec:
    """The filter a silo commits to at registration: from its budget and a horizon, never outputs."""
    return spread_spec(committed_order(horizon, epsilon=epsilon, delta=delta), source="horizon")


def default_spec(*, epsilon: float, delta: float, dataset_size: int) -> FilterSpec:
    return horizon_spec(epsilon=epsilon, delta=delta, horizon=rdp.certified_curve(default_horizon(dataset_size)))


def legacy_spec(orders: Sequence[float] = rdp.ORDERS) -> FilterSpec:
    """The union bound over every order the old rule could approve at, with δ split evenly."""
    # Rounded down, so that the float shares never sum past 1.
    share = math.nextafter(1.0 / len(orders), 0.0)
    return FilterSpec(tuple(orders), tuple([share] * len(orders)), "legacy")

