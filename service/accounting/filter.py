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

Where the shares go (allocate, the rule since the filter of one order at 0.9 and 0.1 spread thin
over the other 155, whose early readings cost ln(1550)/(α − 1) over the best order's): on the few
orders that are best along the horizon's path, its prefixes from one unit to the whole horizon.
The shares minimise the worst ratio of the filter's reading to the unproven best-order ε along that
path, holding the path's end (where the budget binds) to 1 + END_EXCESS, with REST_WEIGHT spread
over the other orders for workloads off the path; allocate states the rule and the bound exactly.

A plan beside the filter (accounting/plans.py, ALONGSIDE) is one more branch of the same union
bound. The silo's δ is split: δ·s to the plan, δ·(1 − s)·w_i to order α_i. Let P be the branch "every
charge approved so far is the plan's next units"; the gate approves while P is alive and the plan's
PLD ε (at δ·s) ≤ ε, or some F_i is alive. On the transcripts where P stays alive to the end, the
interaction coincides with a post-processing of the plan's full run, non-adaptive and declared
before the first charge: stopping early, and which of its units a refusal left out, are functions
of the plan's own outputs and of nothing else (a refusal reads only mechanisms, never outputs). So
its hockey-stick divergence at e^ε on those transcripts is at most δ·s; on the others some F_i
stayed alive, at most δ·(1 − s)·w_i each. The sum is at most δ. A charge off the plan kills P for
good (the silo records it, plan_ended_seq), and from then on only the filter's reading counts.

The rule before the filter (some order of 156, each with the whole δ, chosen when checking) is that union bound
without the split, and a two-step randomized-response interaction shows it false (README).
Everything here is O(number of filter orders): the running sum is already kept per order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpledger.service.accounting import conversion, cost, rdp
from dpledger.wire.mechanisms import AnyMechanism, DpSgd, children

# The path allocation (see allocate): REST_WEIGHT of δ is spread evenly over every order the path
# does not use. A Poisson-sampled Gaussian's RDP jumps by orders of magnitude within a few orders
# (q = 0.01, σ = 1: 0.04 at α = 10, 0.98 at α = 12), so a workload unlike the horizon is cheapest at
# an order the path never suggests; the rest share bounds its price there by ln(155/0.01)/(α − 1).
REST_WEIGHT = 0.01
# ...unless the path's end cannot be held with that much left over: where ε grows slowly at the end
# (a central job at q = 0.0024, σ 1.18: 0.15% of ε per 10% of the rounds), the 1% costs its order
# ln(1/0.99)/(α − 1), 0.13% of ε and 9% of the rounds. Then the rest yields, to a tenth and then
# to REST_LEAST, and a workload off the path pays ln(155/0.0001)/(α − 1) instead.
REST_LEAST = 1e-4
# The path's goal profile: the reading allowed at a prefix of t units, as an excess over the best
# order's ε at the whole δ, in units of one scale s that the allocation makes as small as it can:
# 1 + s·excess(t). At s = 1 the reading is within 1.5× from the first unit, 1.25× from 3, 1.15×
# from a tenth of the horizon on and 1.03× over its end (within END_SPAN of it), where the budget
# binds and every excess is rounds the silo loses: steps, as the goals read. (Interpolated in log t
# between the knots, the profile asked more than the goals do between them, and paid for it at
# them: bench/tightness.py's worst after 1 / 3 units / a tenth, seed 0, went from 1.513 / 1.346 /
# 1.233 to 1.353 / 1.291 / 1.224 off the plan variants when the profile became steps.)
GOAL_FIRST, GOAL_THIRD, GOAL_TENTH, END_EXCESS = 0.5, 0.25, 0.15, 0.03
END_SPAN = 1.1
# A horizon that takes more units than this to spend the budget reads ~0 everywhere: refused.
MAX_UNITS = 1e10
# horizon_units' bisection, this many steps to a conversion: the 2^levels − 1 mids they might ask.
HORIZON_LEVELS = 3
# The share of the horizon's whole units the budget must still buy under the filter (kept_units): the
# goal's 0.95 and a margin (at 0.95 the ρ bisection spends it early on: central q = 256/60,000, σ 1
# for 10,000 steps reads 1.152 at a tenth of the way, against 1.139 and the goal's 1.15).
ROUNDS_KEPT = 0.96
# ...or, where holding that many costs the first units their goals, the goal's own share: a central
# job at q = 0.039, σ 1.77 whose ε grows 3% over its last 6% of 337 steps held none at 0.96 and
# bought 318 (0.944); at 0.95 it buys 321, read within 1.253 after one step, 1.25 from three on.
ROUNDS_GOAL = 0.95
# ...and where holding even that costs the first units their goals, it is held all the same while the
# goals need at most this scale (a reading within 1.55 / 1.275 / 1.165 after 1 / 3 units / a tenth):
# where ε grows slowly at the end, the end's 3% is several times that in rounds, and the rounds are
# what the budget buys. A central job at q = 0.0283, σ 0.652 bought 105 of 116 steps (0.905) with its
# goals met, where holding 111 scales them by 1.019; a federated one (q = 0.024, σ 2.42, 8 steps a
# round) 24 of 26 rounds, where holding 25 scales them by 1.037 (bench/tightness.py, seed 16).
UNITS_SCALE = 1.1
# The goal's share of the units after a search, or of a workload the silo did not declare (a refit):
# held with the goals scaled (UNITS_SCALE) only down to it there. Holding ⌈0.95·K⌉ there read a central
# job's third step at 1.259 (goal 1.25) that bought 0.943 of its steps unheld (bench/tightness.py, seed 13).
ROUNDS_GOAL_AFTER = 0.9
# The path's prefixes: every whole unit up to PATH_UNITS, then PATH_POINTS geometric steps to the end.
PATH_UNITS = 16
PATH_POINTS = 48
# The searches on the scale s and on ρ (_Path.least: a bisection's answer): the scale's upper end (a
# reading within 1 + MAX_SCALE·0.5 after one unit), and when they stop. A cover costs ~0.3 ms, a
# cut's reading at a grid of points a few % of that; s only sets the caps, within 1e-3·excess of
# the least that fit, and ρ the reading along the path, within 1e-4 of its least.
MAX_SCALE = 128.0
SCALE_TOLERANCE = 1e-3
RHO_TOLERANCE = 1e-4
# _Path.least's grid: the points a pass of it reads a cut at, each pass narrowing its interval this many times.
LEAST_GRID = 32
# The filter of the rule before the path allocation (kept for the quote of a mechanism on no silo):
# COMMITTED_WEIGHT on one order, the rest spread evenly over every other order of the grid.
COMMITTED_WEIGHT = 0.9
# The default horizon: DP-SGD at a batch of 256 with noise multiplier 1, run until
# it spends the budget. Its best order is where a typical training run's ε is lowest.
HORIZON_BATCH = 256
HORIZON_NOISE = 1.0
# ...but never sampling more than 1% of a small set: q = 256/1000 would commit order 16, where one
# step at q = 0.01 reads 1.77 against its best order's 0.96 (a small silo trains on small batches).
HORIZON_MAX_RATE = 0.01


_GRID = frozenset(rdp.ORDERS)
# The scale of each order's need (_Path._needs): α − 1, a column.
_SLOPES = (np.array(rdp.ORDERS) - 1)[:, None]
_SLOPES.flags.writeable = False
# Above this exponent a need is above 1 (exp(x) rounds above 1 for every x ≥ 2^-52), so reads none.
_NEED_CUT = 1e-12
# _Path.fits' margin over the rounding of its sums (~1e-14 relative): a cut's sum this far within
# the budget proves the cover fits.
FITS_MARGIN = 1e-9


@dataclass(frozen=True)
class FilterSpec:
    orders: tuple[float, ...]  # each one of rdp.ORDERS
    weights: tuple[float, ...]  # δ shares, summing to at most 1
    # "horizon" (declared at registration), "first_charge" (fixed from the silo's first charge, see
    # first_charge_spec), "pending" (a silo with no declared horizon before its first charge: never
    # read by the gate, which prices that charge under the filter it would fix), or "legacy" (the
    # orders a pre-filter silo was gated on).
    source: str
    # A filter fitted to a declared horizon: the digests (mechanism_digest) of the horizon and of every
    # mechanism inside it, so that its first charge tells a part of what was declared from a workload
    # the silo did not declare (refit_spec). Empty on every other filter, and on filters stored before.
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.orders) != len(self.weights) or not self.orders:
            raise ValueError("a filter needs one weight per order, and at least one order")
        if not _GRID.issuperset(self.orders):
            raise ValueError("filter orders must be orders of the ledger's grid")
        # Summed exactly (no tolerance): the shares split δ, so a sum past 1 would spend past δ. fsum is
        # the exact sum correctly rounded, so fsum < 1 proves it below 1 (rounding is monotone); only
        # a sum that rounds to 1 or more is summed in Fractions (~1 ms for 156 shares).
        if any(not w > 0 for w in self.weights) or (
                math.fsum(self.weights) >= 1 and sum(map(Fraction, self.weights)) > 1):
            raise ValueError("filter weights must be positive and sum to at most 1")

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(rdp.ORDERS.index(a) for a in self.orders)

    def to_json(self) -> str:
        data: dict[str, object] = {"orders": list(self.orders), "weights": list(self.weights), "source": self.source}
        if self.parts:
            data["parts"] = list(self.parts)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FilterSpec:
        return _parsed(text)


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> FilterSpec:
    # Every approval reads its silo's filter from the row; parsing and validating it once per text.
    data = json.loads(text)
    return FilterSpec(tuple(float(a) for a in data["orders"]), tuple(float(w) for w in data["weights"]), str(data["source"]),
                      tuple(str(p) for p in data.get("parts", ())))


@dataclass(frozen=True)
class Reading:
    epsilon: float  # min_i ε_i: the proven ε of the history so far
    order: float  # the order that gives it


order_epsilon = conversion.order_epsilon
order_epsilons = conversion.order_epsilons


def read(spec: FilterSpec, curve: np.ndarray, *, delta: float) -> Reading:
    """The proven ε of a running sum (a curve on rdp.ORDERS) under the silo's filter."""
    orders, indices, terms = _read_terms(spec, delta)
    eps = conversion.epsilons(terms, curve[indices])
    best = int(np.argmin(eps))
    return Reading(float(eps[best]), float(orders[best]))


@functools.lru_cache(maxsize=4096)
def _read_terms(spec: FilterSpec, delta: float) -> tuple[np.ndarray, np.ndarray, conversion.Terms]:
    # Every approval reads its silo's filter at its δ: the terms of the orders and δ shares once.
    orders, weights, indices = _arrays(spec)
    # One ulp down from the rounded product: each δ_i ≤ δ·w_i exactly, so Σδ_i ≤ δ.
    terms = conversion.order_terms(orders, np.nextafter(delta * weights, 0.0))
    for shared in (orders, indices, *terms):
        shared.flags.writeable = False  # kept for every later read of this filter
    return orders, indices, terms


def read_many(spec: FilterSpec, curves: np.ndarray, *, delta: float) -> np.ndarray:
    """`read(spec, row, delta=delta).epsilon` of each row of `curves`, in one numpy pass: an audit
    reads a silo's running sum after each of its entries (~30 µs a read, one at a time)."""
    orders, weights, indices = _arrays(spec)
    eps: np.ndarray = order_epsilons(orders, curves[:, indices], np.nextafter(delta * weights, 0.0)).min(axis=1)
    return eps


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


def horizon_units(horizon: np.ndarray, *, epsilon: float, delta: float, offset: np.ndarray | None = None) -> float:
    """How many times `horizon` runs (after `offset`) before it spends ε at δ (by dp-accounting's
    best-order conversion).

    Scaling a curve by m is running its workload m times; bisection on m in log space finds the m
    whose ε is the budget (a finite, positive curve's ε grows with m)."""
    finite = np.isfinite(horizon) & (horizon > 0)
    if not finite.any():
        raise ValueError("the horizon's RDP curve is infinite or zero at every order")
    curve = np.where(finite, horizon, np.inf)
    base = np.zeros(len(curve)) if offset is None else offset
    lo, hi = 1e-9, 1e12
    steps, done = 0, False
    while not done:
        # The bisection's next HORIZON_LEVELS steps at once: every mid they could ask for (the tree
        # of its possible brackets, breadth first: node k's are 2k + 1 below its mid, 2k + 2 above)
        # converted in one call, then walked a step at a time as before. The same mids in the same
        # arithmetic, so the same lo: 12 calls of 7 curves, ~0.5 ms, where 36 of one were ~0.8 ms.
        mids: list[float] = []
        level = [(lo, hi)]
        for _ in range(HORIZON_LEVELS):
            split = [(a, math.sqrt(a * b), b) for a, b in level]
            mids += [mid for _, mid, _ in split]
            level = [bracket for a, mid, b in split for bracket in ((a, mid), (mid, b))]
        # rdp.epsilons: dp-accounting's conversion to the bit, ~30× faster than its loop over the
        # orders; row by row, each row's ε is the one its curve alone reads.
        above = (rdp.epsilons(base + curve * np.array(mids)[:, None], delta=delta) > epsilon).tolist()
        node = 0
        for _ in range(HORIZON_LEVELS):
            if above[node]:
                hi = mids[node]
            else:
                lo = mids[node]
            steps += 1
            done = hi / lo < 1 + 1e-9 or steps == 200
            if done:
                break
            node = 2 * node + (1 if above[node] else 2)
    if lo > MAX_UNITS:  # ~0 at every order (σ ~ 1e9): no path of it ever reaches the budget
        raise ValueError(f"the horizon spends less than the budget in {MAX_UNITS:.0e} units: declare the workload the silo runs")
    return lo


def committed_order(horizon: np.ndarray, *, epsilon: float, delta: float) -> float:
    """The order at which `horizon` scaled to spend exactly ε at δ has its lowest ε."""
    units = horizon_units(horizon, epsilon=epsilon, delta=delta)
    _, order = rdp.epsilon(np.where(np.isfinite(horizon) & (horizon > 0), horizon, np.inf) * units, delta=delta)
    return float(order)


def path_prefixes(units: float) -> np.ndarray:
    """The path of a horizon of `units` units: every whole unit from the first up to PATH_UNITS, then
    PATH_POINTS geometric steps to `units` itself (just `units` when it is less than one)."""
    if units <= 1:
        return np.array([units])
    whole = np.arange(1, min(math.floor(units), PATH_UNITS) + 1, dtype=float)
    steps = np.geomspace(min(PATH_UNITS, units), units, PATH_POINTS + 1)
    # Where a goal starts (goal_excess), a prefix: the units between it and the next prefix are read
    # within that goal too, not only within the looser one before it.
    knots = [k for k in (_tenth(units), math.ceil(units / END_SPAN)) if 1 <= k <= units]
    return np.unique(np.concatenate([whole, steps, knots]))


def _tenth(units: float) -> float:
    """The first whole unit a tenth of the horizon's goal holds from: ⌊K/10⌋, so that a horizon of
    K = 70.2 units (a run of 70, certified a hair tighter) holds it from the run's seventh."""
    return float(math.floor(units / 10))


def goal_excess(prefixes: np.ndarray, units: float) -> np.ndarray:
    """The goal profile's excess at each prefix (see GOAL_FIRST), as the goals read: 0.5 from one
    unit, 0.25 from three, 0.15 from a tenth of the horizon, END_EXCESS within END_SPAN of its end;
    on a short horizon a later goal that starts sooner (a tenth of 20 units is 2) holds from its start."""
    knots = [(3.0, GOAL_THIRD), (_tenth(units), GOAL_TENTH), (units / END_SPAN, END_EXCESS)]
    profile = np.full(np.shape(prefixes), GOAL_FIRST)
    for start, excess in knots:
        profile = np.where(prefixes >= start, np.minimum(profile, excess), profile)
    return profile


@dataclass(frozen=True)
class Allocation:
    """A path allocation and the bound it guarantees (see allocate)."""

    spec: FilterSpec
    units: float  # the horizon's length in units: where it spends the budget
    prefixes: tuple[float, ...]  # the path's prefixes, in units
    bounds: tuple[float, ...]  # at each prefix, the filter reads at most this × the best order's ε at the whole δ

    @property
    def ratio(self) -> float:
        """The worst ratio the allocation guarantees along its path."""
        return max(self.bounds)

    @property
    def end_ratio(self) -> float:
        """The ratio it guarantees at the horizon's end."""
        return self.bounds[-1]


def kept_units(units: float, share: float = ROUNDS_KEPT) -> float | None:
    """The whole units the filter fitted to a horizon of `units` (horizon_units: K, fractional) holds
    to read at most the budget: ⌈share·⌊K⌋⌉ of dp-accounting's whole units, but at most ⌈K⌉ − 1
    (at ⌊K⌋ = K, only the best order on the whole δ reads E(K): under 25 units, ⌈0.96·K⌉ is K itself,
    and one unit is the least that is lost). None under 2 units. Whole, not ROUNDS_KEPT·K: the gate
    approves units, and 0.96 × 30 = 28.8 held bought 28 of 30; under 25 units nothing was held, and a
    13-round horizon bought 11 (bench/tightness.py), a 6-step one whose ε barely grows none."""
    # horizon_units' bisection stops up to 1e-9 (relative) under the K it brackets: 39 units read 38.99999996.
    whole = math.floor(units * (1 + 1e-8))
    if whole < 2:
        return None
    return float(min(math.ceil(share * whole - 1e-9), math.ceil(units) - 1))


def allocate(horizon: np.ndarray, *, epsilon: float, delta: float, offset: np.ndarray | None = None,
             rounds_goal: float | None = ROUNDS_GOAL) -> Allocation:
    """The filter of a silo whose workload is `horizon` (one unit's curve), after `offset` (a charge
    that comes first and is not the workload's unit, such as a hyperparameter search), for a budget (ε, δ).

    The rule. K = horizon_units (offset + K units spend ε); the path is path_prefixes(K), every whole
    unit from the first; E(t) is dp-accounting's conversion of offset + t units at their best grid
    order with the whole δ (the unproven rule's reading), and c_α(t) the conversion at order α with
    the whole δ. An order α holding share w reads c_α(t) + ln(1/w)/(α − 1) at t, so it keeps t within
    a ratio r of E(t) iff w ≥ need_α(t, r) = exp(−(r·E(t) − c_α(t))(α − 1)). Given targets r(t),
    the path is cut into runs of consecutive prefixes, each read by one order holding the largest
    need of its run, and a dynamic program finds the cut of least total share (_cheapest_cut).
    Two bisections choose the targets. First the goals: r(t) = 1 + s·excess(t) (goal_excess: 1.5 /
    1.25 / 1.15 / 1.03 at s = 1), the end's prefixes (t ≥ K/END_SPAN, where the budget binds and an
    excess is rounds lost) held at 1 + END_EXCESS where that fits, and so is the prefix of the rounds
    the budget buys (_Path.of: ⌈0.96·K⌉, or the goal's ⌈0.95·K⌉ where the goals still fit, or
    `rounds_goal`'s share, 0.9 after a search, with the goals scaled by up to UNITS_SCALE); s* the least scale whose total
    fits 1 − REST_WEIGHT, and the caps c(t) those targets at max(s*, 1). Then as tight as the caps
    allow everywhere: r(t) = 1 + min(ρ, c(t) − 1) at the least ρ that fits (a path that can be read
    within 1.14 everywhere is, although its goals allow 1.5 at its start). The orders so chosen get
    their shares scaled up to 1 − REST_WEIGHT, and REST_WEIGHT is spread evenly over every other
    order of the grid (less, down to REST_LEAST, where the end cannot be held with it). With an
    offset, the path starts with the offset alone (t = 0), at the first unit's goal.

    The bound. At every prefix t of the path the filter reads at most r(t)·E(t) (Allocation.bounds),
    and at every whole unit u between two prefixes t < u < t' at most max(r(t), r(t'))·E(u): one
    order α reads both t and t' within their targets (a run that ends before such a gap reads the
    prefix after it, _cheapest_cut), its reading c_α(u) + ln(1/w)/(α − 1) is linear in u and E(u),
    a minimum of such lines, concave, so their difference is convex in u and at most its larger end.
    Each goal's first unit is a prefix (path_prefixes), so a unit is read within the goal it is
    under. The prefixes are every whole unit up to PATH_UNITS, then 1/48 of the path's log-length
    apart (and the goals' first units). A workload off the path
    reads at most ln((N − m)/rest)/(α − 1) above its best order's ε at the whole δ, where α is that
    order, N the grid's size, m the path's orders and rest the share spread off the path.

    The bounds hold up to the rounding of the shares (each rounded down, so that they never sum past
    1). Only the budget, δ, the horizon and the offset enter, never an output, so the filter is
    fixed before the silo's first charge and the gate stays the union bound above."""
    # Work no mechanism's price counts (a registration's, a first charge's, a refit's): the request's
    # CPU bound widens by it as it starts, so that a busy machine's slower allocation is no overrun.
    cost.allow(cost.FIRST_FILTER_SECONDS)
    goal = rounds_goal if rounds_goal is None or offset is None else min(rounds_goal, ROUNDS_GOAL_AFTER)
    path = _Path.of(horizon, epsilon=epsilon, delta=delta, offset=offset, rounds_goal=goal)
    # Only max(s*, 1) is used: where the goals themselves fit, s* is not sought; where they do not,
    # it is bracketed by doubling from 1 (it is rarely above 4) before the search.
    lo, hi = 1.0, 1.0
    while hi < MAX_SCALE and not path.fits(path.goals(hi)):  # fits(MAX_SCALE) holds: _Path.of checked it
        lo, hi = hi, min(2 * hi, MAX_SCALE)
    caps = path.goals(path.least(path.goals, lo, hi, tolerance=SCALE_TOLERANCE)) - 1  # lo = hi = 1 where the goals fit
    rho = path.least(lambda r: 1 + np.minimum(r, caps), 0.0, float(caps.max()), tolerance=RHO_TOLERANCE)
    bounds = 1 + np.minimum(rho, caps)
    total, shares = path.cover(bounds)
    return Allocation(_spec_of(shares, total, rest=path.rest), path.units, tuple(path.prefixes.tolist()), tuple(bounds.tolist()))


def check_allocatable(horizon: np.ndarray, *, epsilon: float, delta: float) -> None:
    """Raises allocate's ValueError where no filter of the grid can read the horizon's path, without
    the two bisections that choose one (a registration with no horizon validates its budget so: its
    first charge fixes the filter, ~4× the work)."""
    _Path.of(horizon, epsilon=epsilon, delta=delta, offset=None, rounds_goal=ROUNDS_GOAL)


@dataclass
class _Covers:
    """The covers of one path's targets, whatever its rest: each by its targets' bytes (allocate's
    last cover is one of its bisections', and _Path.of asks each rest for the same goals), and the
    cut of the latest one computed (_Path.fits)."""

    by_targets: dict[bytes, tuple[float, dict[int, float]]] = dataclasses.field(default_factory=dict)
    cut: _Cut | None = None


@dataclass(frozen=True)
class _Cut:
    """A cut of the path into runs: the first prefix of each run, and the order that reads each prefix."""

    starts: np.ndarray
    orders: np.ndarray


@dataclass(frozen=True)
class _Path:
    """A horizon's path as allocate reads it: its prefixes, the conversion of each at every order
    (conv) and at the best one (best), each prefix's goal excess, and whether the end is held."""

    units: float
    prefixes: np.ndarray
    excess: np.ndarray
    conv: np.ndarray
    best: np.ndarray
    at_end: np.ndarray
    held: bool
    rest: float = REST_WEIGHT
    memo: _Covers = dataclasses.field(default_factory=_Covers, compare=False, repr=False)

    @property
    def budget(self) -> float:
        """The total share the path's orders may hold: what the rest leaves."""
        return 1 - self.rest

    @functools.cached_property
    def gaps(self) -> np.ndarray:
        """Whether a whole unit lies strictly between prefix j and j + 1: a unit a job may stop at
        (once a path: every fits and cover reads it)."""
        gaps: np.ndarray = np.ceil(self.prefixes[1:]) - 1 > self.prefixes[:-1]
        return gaps

    @classmethod
    def of(cls, horizon: np.ndarray, *, epsilon: float, delta: float, offset: np.ndarray | None,
           rounds_goal: float | None) -> _Path:
        """The path, or a ValueError where no order reads it or no filter reads it within the largest ratio;
        `rounds_goal`: the share of its units held with the goals scaled (UNITS_SCALE), where less is held
        at scale 1 (None: none held so)."""
        base = np.zeros(len(rdp.ORDERS)) if offset is None else np.where(np.isfinite(offset), np.maximum(offset, 0.0), np.inf)
        units = horizon_units(horizon, epsilon=epsilon, delta=delta, offset=base)
        # The rounds the budget buys: the prefix kept_units(K) is held to read at most the budget itself
        # (E(K)), so that the gate affords that many of dp-accounting's units however slowly ε grows
        # there (sublinear growth turns an END_EXCESS in ε into several times that in rounds).
        # The kept prefix at scale 1, then the one before it where that is still the goal's share, then
        # ROUNDS_GOAL's: at scale 1, then `rounds_goal`'s with the goals scaled up to UNITS_SCALE; below the goal's
        # share only where nothing holds it (its ε barely below the budget's: 4 of 4.000004 units read
        # 1 − 2e-6 of it).
        keep = kept_units(units)
        least = kept_units(units, ROUNDS_GOAL)
        held: list[tuple[float, float]] = []  # (the prefix held, the goals' scale it may take), in that order
        if keep is not None and least is not None:
            held = [(whole, 1.0) for whole in dict.fromkeys([keep, *([keep - 1] if keep - 1 >= least else []), least])]
            scaled = None if rounds_goal is None else kept_units(units, rounds_goal)
            if scaled is not None:
                held.append((scaled, UNITS_SCALE))  # the goal's share before the first units' goals (UNITS_SCALE)
            if keep - 1 < least and keep >= 2:
                held.append((keep - 1, 1.0))  # below the goal: where no scale holds it (4 of 4.000004 units)
        tries = [whole for whole, _ in held]
        prefixes = np.unique(np.append(path_prefixes(units), tries))
        excess = goal_excess(prefixes, units)
        if offset is not None:
            prefixes, excess = np.concatenate([[0.0], prefixes]), np.concatenate([[GOAL_FIRST], excess])
        orders = np.array(rdp.ORDERS)
        curve = np.where(np.isfinite(horizon), np.maximum(horizon, 0.0), np.inf)
        full = np.full((len(orders), 1), delta)
        with np.errstate(invalid="ignore"):  # 0 × ∞ at t = 0: that order is ∞ in the offset alone anyway
            # Every prefix at once (order × prefix): one conversion, not one per prefix.
            spent = base[:, None] + np.nan_to_num(curve[:, None] * prefixes[None, :], nan=0.0)
            conv = order_epsilons(orders[:, None], spent, full)
        best = conv.min(axis=0)
        kept = np.isfinite(best) & (best > 0)  # a prefix no order reads above 0 needs nothing
        if not kept.any():
            raise ValueError("the horizon reads ε = 0 or ∞ at every prefix of its path")
        conv, best, prefixes, excess = conv[:, kept], best[kept], prefixes[kept], excess[kept]
        at_end = prefixes >= units / END_SPAN
        memo = _Covers()  # the variants below share conv and best: a cover of the same targets is the same
        # Each kept prefix held like the end's, to read at most the budget itself (E(K)), where the path
        # still meets its goals so (at scale 1), or the goal's share with the goals within UNITS_SCALE;
        # then none held, the goals scaled where they must be.
        rests = (REST_WEIGHT, REST_WEIGHT / 10, REST_LEAST)
        variants: list[tuple[np.ndarray, np.ndarray, float, tuple[float, ...]]] = []
        for whole, scale in held:
            held_at = prefixes == whole
            if held_at.any() and best[-1] > best[held_at][0]:
                # With its goals scaled, a held prefix takes the least rest: each share the rest leaves the
                # path is a smaller scale on every goal (1.053 → 1.019, the job at σ 0.652 of UNITS_SCALE).
                variants.append((np.where(held_at, np.minimum(excess, best[-1] / best[held_at][0] - 1), excess),
                                 at_end | held_at, scale, rests if scale == 1.0 else (REST_LEAST,)))
        variants.append((excess, at_end, MAX_SCALE, rests))
        for goals, ends, scale, tried in variants:
            for rest in tried:
                path = cls(units, prefixes, goals, conv, best, ends, held=True, rest=rest, memo=memo)
                if path.fits(path.goals(scale)):
                    return path
        path = cls(units, prefixes, excess, conv, best, at_end, held=False, memo=memo)  # the end scaled like every prefix
        if not path.fits(path.goals(MAX_SCALE)):
            raise ValueError("no filter of the grid's orders reads this horizon's path within the largest ratio")
        return path

    def cover(self, targets: np.ndarray) -> tuple[float, dict[int, float]]:
        """The least total share that reads every prefix j within targets[j] × best[j] (_cheapest_cut)."""
        key = targets.tobytes()
        if key in self.memo.by_targets:
            return self.memo.by_targets[key]
        return self._cover(key, *self._needs(targets))

    def fits(self, targets: np.ndarray) -> bool:
        """Whether cover(targets)'s total is within the budget: proven from a cheaper cut where one can,
        the same answer either way.

        Any cut's runs, each read by one order, sum to at least the least cut's total (the dynamic
        program's least: it is the least of the same sums, rounded as they are), and cover's total,
        one share per order (the largest of its runs, so at most the sum of its cut's runs), is at
        most that least; each up to the rounding of the sums, ~1e-14 relative for a few hundred
        runs. So a cut whose sum is within the budget by FITS_MARGIN proves that the cover fits,
        without its dynamic program: the latest computed cover's cut, its runs read by the orders
        that read them then (it proves about half of a bisection's covers), or, until the path has
        one, _short_cut's (the loosest covers and the dearest to compute). Where none does, the
        cover decides (and its False is never proven so: a cut's sum bounds the total from above only)."""
        key = targets.tobytes()
        if key in self.memo.by_targets:
            return self.memo.by_targets[key][0] <= self.budget
        cut = self.memo.cut
        if cut is not None and self._proven(cut, targets[None, :])[0]:
            return True
        live, rows = self._needs(targets)
        if cut is None and len(rows) and _short_cut(live, self.gaps) * (1 + FITS_MARGIN) <= self.budget:
            return True
        return self._cover(key, live, rows)[0] <= self.budget

    def _proven(self, cut: _Cut, targets: np.ndarray) -> np.ndarray:
        """For each row of `targets` (a target per prefix), whether `cut`'s runs, each read by the order
        that reads it in the cut, sum within the budget by FITS_MARGIN: then the cover fits (fits)."""
        columns = np.arange(len(cut.orders))
        slopes = _SLOPES[cut.orders, 0]
        with np.errstate(over="ignore", invalid="ignore"):  # as _needs reads them
            need = np.exp((self.conv[cut.orders, columns] - targets * self.best) * slopes)
        runs = np.maximum.reduceat(np.where(need <= 1, need, np.inf), cut.starts, axis=1)
        crossing = self.gaps[cut.starts[1:] - 1]  # a run before a gap reads the prefix after it (_cheapest_cut)
        nexts = cut.starts[1:][crossing]
        with np.errstate(over="ignore", invalid="ignore"):
            ahead = np.exp((self.conv[cut.orders[nexts - 1], nexts] - targets[:, nexts] * self.best[nexts])
                           * slopes[nexts - 1])
        before = runs[:, :-1]  # a view: the runs that end before another
        before[:, crossing] = np.maximum(before[:, crossing], np.where(ahead <= 1, ahead, np.inf))
        proven: np.ndarray = runs.sum(axis=1) * (1 + FITS_MARGIN) <= self.budget
        return proven

    def least(self, targets_of: Callable[[np.ndarray], np.ndarray], lo: float, hi: float, *, tolerance: float) -> float:
        """The least x in [lo, hi] (to `tolerance`, from above) whose targets (`targets_of`, of a column
        of x: a row of targets each) fit, where hi's do and fitting is monotone in x: a bisection's
        answer, with most of its covers replaced by the latest cover's cut.

        That cut's runs sum to at least the cover's total at every x (fits), so the least x where they
        fit the budget, found on a grid of LEAST_GRID points a pass (one numpy pass for all of them,
        a few % of a cover), fits without a cover. One cover `tolerance` below it then either fails,
        and it is the answer, or gives a new cut to search with; where the cut proves nothing, a
        bisection step. Where that cover fits too, the total lies flat just under the budget and each
        new cut proves little below its own x: the next probe steps down 4× as far (stepping by
        `tolerance` would cost a cover a step). ~3 covers where a bisection computed ~8
        (docs/benchmarks.md, a silo's first touch)."""
        step = tolerance
        while hi - lo > tolerance:
            cut, low, proven = self.memo.cut, lo, False
            while cut is not None and hi - low > tolerance:
                xs = np.linspace(low, hi, LEAST_GRID + 1)[1:]
                holds = self._proven(cut, targets_of(xs[:, None]))
                if not holds.any():
                    break
                first = int(np.argmax(holds))
                hi, low, proven = float(xs[first]), float(xs[first - 1]) if first else low, True
            # Just below the cut's least, or halfway where that is not above lo (hi − lo rounds a hair
            # above the tolerance after a failed probe: probing lo again would never end).
            probe = hi - step if proven and hi - step > lo else (lo + hi) / 2
            if self.fits(targets_of(np.array([[probe]]))[0]):
                hi, step = probe, step * 4 if proven else tolerance
            else:
                lo, step = probe, tolerance
        return hi

    def _needs(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The need of every order that may read some prefix within its target (rows, ascending), ∞ where
        it reads none; every order left out reads none."""
        with np.errstate(over="ignore", invalid="ignore"):
            # need_α(t) = exp(−(r·E − c_α)(α − 1)), with c_α − r·E for −(r·E − c_α): the same float
            # (rounding to nearest is symmetric), and an exact 0 reads 1 either way.
            exponent = (self.conv - targets * self.best) * _SLOPES
        # An order whose exponent is above _NEED_CUT at every prefix needs more than 1 at each: it reads
        # none (∞), and is left out before the exponentials (about half the orders, on a tight path).
        rows = np.flatnonzero((exponent <= _NEED_CUT).any(axis=1))
        with np.errstate(over="ignore"):
            need = np.exp(exponent[rows])
        return np.where(need <= 1, need, np.inf), rows

    def _cover(self, key: bytes, live: np.ndarray, rows: np.ndarray) -> tuple[float, dict[int, float]]:
        total, shares, cut = _cheapest_cut(live, rows, self.gaps)
        self.memo.by_targets[key] = total, shares
        if cut is not None:
            self.memo.cut = cut
        return total, shares

    def goals(self, scale: float | np.ndarray) -> np.ndarray:
        """The targets at scale s: 1 + s·excess, the end's prefixes at most 1 + excess where it is held
        (a row of targets for each row of a column of scales)."""
        targets: np.ndarray = 1 + np.where(self.at_end & self.held, np.minimum(scale, 1.0), scale) * self.excess
        return targets


def _short_cut(live: np.ndarray, gaps: np.ndarray) -> float:
    """The least sum of a cheap cut of the prefixes (for _Path.fits, until a path has a cut of its
    own): one run per prefix, one run, or two, each read by its best order (five numpy passes,
    where a loose path's cover costs ~1 ms)."""
    with np.errstate(invalid="ignore"):
        first = np.maximum.accumulate(live, axis=1).min(axis=0)  # the run from the first prefix to each
        last = np.maximum.accumulate(live[:, ::-1], axis=1).min(axis=0)[::-1]  # from each to the last
        # A run that ends before a gap with a whole unit in it reads the prefix after it too (_cheapest_cut).
        pairs = np.where(gaps, np.maximum(live[:, :-1], live[:, 1:]), live[:, :-1]).min(axis=0)
    return min(float(pairs.sum() + live[:, -1].min()), float(first[-1]),
               float((np.where(gaps, first[1:], first[:-1]) + last[1:]).min(initial=np.inf)))


def _cheapest_cut(live: np.ndarray, rows: np.ndarray, gaps: np.ndarray) -> tuple[float, dict[int, float], _Cut | None]:
    """live[i, j]: the δ share order rows[i] needs to read prefix j within target (∞: none suffices;
    `rows` ascending, every other order reading none). The least total share that reads every prefix,
    cutting them into runs of consecutive prefixes each read by one order at the largest need of its
    run (and of the next prefix, where gaps[j] says a whole unit lies between prefix j and j + 1);
    the share of each order it uses; and its cut (None where no cut reads every prefix).

    The dynamic program over the cuts: least[e], the least total of the prefixes before e, is the
    least over a < e of least[a] + steps[a, e] (the run a … e − 1: _steps); then the cut follows
    each e back to the first a of least total (the first of equal totals, as an argmin), and each
    run goes to the first order of least need over it. The program's equations have one solution
    (least[e] reads only least[a], a < e), so least is found by relaxing every e at once from the
    one-run totals until nothing moves: a numpy pass per run of the longest least cut, and one more
    (~4 passes on allocate's paths), each e the least of the same float sums as one e at a time in
    plain Python, which cost ~0.2 ms a cover, and ~0.1 ms more to make its ~2,000 runs Python floats.
    A cover costs ~0.4 ms so, where it cost ~1 ms; allocate computes ~7, and _Path.fits proves
    about as many more without one."""
    n_prefixes = live.shape[1]
    if n_prefixes == 0 or len(rows) == 0:
        return math.inf, {}, None
    # A run that ends before a gap holding a whole unit also reads the prefix after it (the run
    # a … e − 1 costs the largest need of a … e): then one order reads both ends of the gap, and so
    # every unit in it (its reading is linear in t, E(t) concave: their difference is convex in t),
    # not only the prefixes (bench/tightness.py read 1.153 at a unit between two runs, goal 1.15).
    steps = _steps(live)
    ahead = np.flatnonzero(gaps) + 1  # the e whose run must read prefix e too
    steps[:, ahead] = steps[:, ahead + 1]
    steps[ahead, ahead] = np.inf  # the run e … e − 1 is none (its cell read e … e)
    steps[0, 0] = 0.0  # least[0] = 0 reads as a step from 0 to itself: every pass keeps it
    least = steps[0].copy()
    while True:
        relaxed = (least[:, None] + steps).min(axis=0)
        if relaxed.tobytes() == least.tobytes():
            break
        least = relaxed
    if not math.isfinite(least[n_prefixes]):
        return math.inf, {}, None
    back = np.argmin(least[:, None] + steps, axis=0).tolist()  # the first of equal totals, as an argmin
    starts = [n_prefixes]
    while starts[-1] > 0:
        starts.append(back[starts[-1]])
    starts = starts[:0:-1]  # the cut's runs, first to last
    largest = np.maximum.reduceat(live, starts, axis=1)  # each order's largest need over each run
    following = np.array(starts[1:], dtype=int)
    over = gaps[following - 1]  # ...and the next run's first prefix, across a gap with a unit in it
    largest[:, :-1][:, over] = np.maximum(largest[:, :-1][:, over], live[:, following[over]])
    chosen = np.argmin(largest, axis=0)  # the first order of least need, as each cut's total used
    needed = largest[chosen, np.arange(len(starts))].tolist()
    shares: dict[int, float] = {}
    for order_index, share in zip(rows[chosen].tolist()[::-1], needed[::-1], strict=True):  # the last run first
        shares[order_index] = max(shares.get(order_index, 0.0), share)  # one order's share reads all its runs
    cut = _Cut(np.array(starts), np.repeat(rows[chosen], np.diff([*starts, n_prefixes])))
    return math.fsum(shares.values()), shares, cut


def _steps(live: np.ndarray) -> np.ndarray:
    """steps[a, e] (a < e; ∞ elsewhere): the least, over the rows of `live`, of the largest need of
    prefixes a … e − 1, a fresh array.

    By run length, doubling: a row's largest need over w < l ≤ 2w prefixes from a is the larger of
    its largest over the w from a and over the w that end where the run does, so each doubling is
    two numpy calls over all its lengths at once (one call per length cost ~6 µs each, 50 of them
    on a tight path). The rows sit flat, each followed by one ∞, so that a window that spans two
    rows reads ∞, and sorted by their count of finite needs: a row with at most w reads ∞ over every
    run longer than w, so each doubling reads only the rows before it (on a tight path a few orders
    read half the path, most others a few prefixes). Max and min pick one of their operands: the
    same floats in whatever order the rows sit."""
    n_rows, n_prefixes = live.shape
    width = n_prefixes + 1
    finite = np.count_nonzero(np.isfinite(live), axis=1)
    by_count = np.argsort(-finite, kind="stable")
    # longer[w]: how many rows have more than w finite needs (the first that many, sorted).
    longer = np.searchsorted(-finite[by_count], -np.arange(n_prefixes), side="left").tolist()
    size = n_rows * width
    # window[p]: the row's largest need over the `length` prefixes from its prefix p, where that
    # window is in one row (∞ where it is not); ∞ past the rows, as far as the next doubling reads.
    window = np.full(size + width, np.inf)
    window[:size].reshape(n_rows, width)[:, :n_prefixes] = live[by_count]
    grid = np.full(n_prefixes * width + 1, np.inf)  # grid[d·width + a]: the run a … a + d; the last, ∞
    table = grid[:-1].reshape(n_prefixes, width)
    if longer[0]:
        np.minimum.reduce(window[: longer[0] * width].reshape(-1, width), axis=0, out=table[0])
    length = 1
    while length < n_prefixes and longer[length]:
        reading = longer[length]
        lengths = min(length, n_prefixes - length)  # the lengths length + 1 … length + lengths
        starts = n_prefixes - length  # a run longer than `length` starts before this
        span = reading * width
        # ahead[r, s − 1, a]: window[r·width + a + s], the window that ends s prefixes later.
        ahead = np.ndarray((reading, lengths, starts), dtype=float, buffer=window, offset=window.itemsize,
                           strides=(width * window.itemsize, window.itemsize, window.itemsize))
        longest = np.maximum(window[:span].reshape(reading, 1, width)[:, :, :starts], ahead)
        np.minimum.reduce(longest, axis=0, out=table[length:length + lengths, :starts])
        if lengths < length:
            break
        window = np.full(span + width, np.inf)
        window[:span].reshape(reading, width)[:, :starts] = longest[:, -1]
        length *= 2
    steps: np.ndarray = grid[_step_cells(n_prefixes)]
    return steps


@functools.lru_cache(maxsize=64)
def _step_cells(n_prefixes: int) -> np.ndarray:
    """_steps' gather: cell (a, e), a < e, is the run a … e − 1 (d = e − 1 − a) in its grid; the others, the ∞."""
    width = n_prefixes + 1
    start, end = np.divmod(np.arange(width * width), width)
    index = np.where(start < end, (end - 1 - start) * width + start, n_prefixes * width).reshape(width, width)
    index.flags.writeable = False
    return index


def _spec_of(shares: dict[int, float], total: float, *, rest: float) -> FilterSpec:
    # Scaled up to 1 − rest (a larger share only lowers its order's reading), a hair under it and
    # each rounded down, so that the float shares never sum past 1.
    scale = (1 - rest) * (1 - 1e-12) / total
    chosen = sorted(shares, key=lambda i: (-shares[i], i))
    weights = [math.nextafter(shares[i] * scale, 0.0) for i in chosen]
    others = [a for i, a in enumerate(rdp.ORDERS) if i not in shares]
    spread = [math.nextafter(rest / len(others), 0.0)] * len(others) if others else []
    return FilterSpec(tuple(rdp.ORDERS[i] for i in chosen) + tuple(others), tuple(weights + spread), "horizon")


def default_horizon(dataset_size: int) -> DpSgd:
    return DpSgd(noise_multiplier=HORIZON_NOISE, steps=1, sampling_rate=min(HORIZON_MAX_RATE, HORIZON_BATCH / dataset_size))


def horizon_spec(*, epsilon: float, delta: float, horizon: np.ndarray) -> FilterSpec:
    """The filter a silo commits to: from its budget and a horizon, never outputs (allocate)."""
    return allocate(horizon, epsilon=epsilon, delta=delta).spec


def declared_spec(*, epsilon: float, delta: float, horizon: AnyMechanism) -> FilterSpec:
    """The filter of a silo registered with `horizon` (resolved in the silo's context): fitted to its
    certified curve (horizon_spec), and carrying the digests of what it declares (horizon_parts)."""
    spec = horizon_spec(epsilon=epsilon, delta=delta, horizon=rdp.certified_curve(horizon))
    return dataclasses.replace(spec, parts=horizon_parts(horizon))


# A horizon names at most this many distinct mechanisms in its filter; past it, none (its first
# charge is then judged as a part of it): the filter's text is read on every approval.
MAX_PARTS = 64


def mechanism_digest(mechanism: AnyMechanism) -> str:
    """A resolved mechanism's identity: 16 hex digits of the SHA-256 of its wire JSON."""
    return hashlib.sha256(mechanism.model_dump_json().encode()).hexdigest()[:16]


def horizon_parts(horizon: AnyMechanism) -> tuple[str, ...]:
    """The digests of a declared horizon and of every mechanism inside it, sorted, each once; ()
    past MAX_PARTS."""
    seen: set[str] = set()
    stack = [horizon]
    while stack:
        mechanism = stack.pop()
        seen.add(mechanism_digest(mechanism))
        if len(seen) > MAX_PARTS:
            return ()
        stack.extend(children(mechanism))
    return tuple(sorted(seen))


# The filters below are pure functions of a silo's terms (ε, δ, n, its first charge's curves) and
# immutable, so silos that share them share one computation (~3–10 ms each: two bisections over
# the path); bounded caches, so a stream of distinct terms costs what it did.
SPEC_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=SPEC_CACHE_SIZE)
def default_spec(*, epsilon: float, delta: float, dataset_size: int) -> FilterSpec:
    return horizon_spec(epsilon=epsilon, delta=delta, horizon=rdp.certified_curve(default_horizon(dataset_size)))


@dataclass(frozen=True)
class FirstCharge:
    """A pending silo's first charge, as its filter is fixed from it (first_charge_spec): its curve,
    and where it is a search (repeat-and-select) of a training run, the run's curve: the job's unit."""

    curve: np.ndarray
    unit: np.ndarray | None = None
    trains: bool = False  # whether it holds a training step (rdp.trains): only such a charge refits a filter
    digest: str | None = None  # its mechanism_digest, where the charge is a mechanism (refit_spec)


def first_charge_spec(*, epsilon: float, delta: float, first: np.ndarray, unit: np.ndarray | None = None,
                      rounds_goal: float | None = ROUNDS_GOAL) -> FilterSpec:
    """The filter of a silo that declared no horizon, fixed at its first charge from that charge's
    curve `first`: the charge is the unit, the horizon as many units as the budget affords (allocate).
    A first charge that is not the job's training unit but a search of it (`unit`: one trial's run)
    does not fix the filter as if the search were the job: the path is the search (`offset`) and then
    the training runs it tunes, so the orders the training needs after it hold their share.

    Sound because nothing that depends on the silo's data exists before its first charge: the
    filter is a function of the budget, δ and the analyst's first request, all fixed before any
    output, so it is fixed before the first charge exactly as the union bound above needs.
    `rounds_goal`: allocate's (None beside a plan, which buys the rounds itself: gate.fixed_spec). (The
    bench's no-horizon silo, charged a round at a time, reads 1.138 / 1.088 / 1.019 after 1 / 3 / 20
    rounds under it, against 1.165 / 1.214 / 1.042 under the default horizon.) A first charge whose
    curve no path can read (zero or ∞ at every order) splits δ evenly over the grid instead."""
    first = np.asarray(first, dtype=float)
    unit = None if unit is None else np.asarray(unit, dtype=float)
    return _first_charge_spec(epsilon, delta, first.tobytes(), None if unit is None else unit.tobytes(), rounds_goal)


@functools.lru_cache(maxsize=SPEC_CACHE_SIZE)
def _first_charge_spec(epsilon: float, delta: float, first: bytes, unit: bytes | None, rounds_goal: float | None) -> FilterSpec:
    first_curve = np.frombuffer(first, dtype=float).copy()  # writable, as a caller's array is
    try:
        spec = (allocate(first_curve, epsilon=epsilon, delta=delta, rounds_goal=rounds_goal) if unit is None
                else allocate(np.frombuffer(unit, dtype=float).copy(), epsilon=epsilon, delta=delta,
                              offset=first_curve, rounds_goal=rounds_goal)).spec
    except ValueError:
        spec = legacy_spec()
    return FilterSpec(spec.orders, spec.weights, "first_charge")


# A registered filter is kept at a first charge that is part of its declared horizon unless, on the
# charge's own workload, it buys fewer than REFIT_UNITS of the units a filter fitted to that charge
# buys (refit_spec). Half, not nearly all: a horizon that declares a job's whole mix of mechanisms is
# fitted to that mix, and its first charge, one part of it, would otherwise refit it to that part and
# leave the rest of the mix short (seen in tests/reliability/test_load.py at 0.95: silos budgeted at
# 1.5× their mix refused before its end). A first charge the horizon does not name is refit wherever
# the fitted filter buys as many units.
REFIT_UNITS = 0.5
# ...and one the horizon does not name wherever it buys fewer than this share of them: an excess of
# 5% at the end of a slow path (fed n = 6,611, σ 0.93, 49 steps a round) cost 27% of the rounds.
REFIT_UNITS_UNNAMED = 0.95


def refit_spec(registered: FilterSpec, *, epsilon: float, delta: float, first: FirstCharge,
               rounds_goal: float | None = ROUNDS_GOAL) -> FilterSpec:
    """The filter a silo registered with a horizon holds from its first charge on: the registered one,
    unless the charge is a training workload (a run, or a search of one: first.trains) and either the
    horizon names the charge (its digest is among registered.parts) and the filter its first charge
    would fix (first_charge_spec) buys at least twice (1 / REFIT_UNITS) as many units of it, or the
    horizon does not name it (the silo runs what it did not declare) and the registered filter buys
    fewer than REFIT_UNITS_UNNAMED of the fitted one's units or reads its path above the goals where
    the fitted filter is within them or nearer (misses_goals; 2.3× after one unit in
    bench/tightness.py); then the fitted one, marked "refit". A filter stored without parts judges
    every charge as named.

    A refit of a charge the horizon does not name may buy fewer of its runs than the registered filter
    (at least ROUNDS_GOAL_AFTER of dp-accounting's, allocate): it reads them within their goals where holding
    the registered filter's units cost the first ones theirs (1.29× after three steps, seed 4). A σ
    quoted before the first charge is calibrated under the filter that charge then fixes
    (silos.plan_noise), so no quote counts on the registered filter's units. A horizon that is the
    workload gives both the same filter. One that is not can cost the silo everything: a central job at
    q = 0.0013, σ 1.17 under a declared batch of 256 of 60,000 at σ 1 was refused its first step, where
    the charge's own filter buys 0.91 of dp-accounting's units. A lone query first (not a training
    step) keeps the registered filter: it says nothing of the job. Sound as first_charge_spec is: a
    function of the budget, δ, the registered filter and the first request, all fixed before any output."""
    if not first.trains:
        return registered
    unit, offset = (first.curve, None) if first.unit is None else (first.unit, first.curve)
    kept = units_bought(registered, unit, offset=offset, epsilon=epsilon, delta=delta)
    named = not registered.parts or first.digest is None or first.digest in registered.parts
    # No filter buys more units than dp-accounting's rule affords (each reads at least the best order's
    # ε at the whole δ), so where the registered filter buys `share` of those and the horizon names the
    # charge or the registered filter meets its goals, neither rule below can refit: no allocation.
    try:
        # + 1: the bisection's rounding, at a budget of exactly K units
        affordable = math.floor(horizon_units(unit, epsilon=epsilon, delta=delta, offset=offset)) + 1
    except ValueError:
        affordable = None
    share = REFIT_UNITS if named else REFIT_UNITS_UNNAMED
    if affordable is not None and kept >= share * affordable and (
            named or not misses_goals(registered, None, unit, offset=offset, units=kept, delta=delta)):
        return registered
    fitted = first_charge_spec(epsilon=epsilon, delta=delta, first=first.curve, unit=first.unit,
                               rounds_goal=rounds_goal if named or rounds_goal is None else min(rounds_goal, ROUNDS_GOAL_AFTER))
    bought = units_bought(fitted, unit, offset=offset, epsilon=epsilon, delta=delta)
    if named and kept > bought:
        return registered
    if kept < share * bought or (not named and misses_goals(registered, fitted, unit, offset=offset, units=kept, delta=delta)):
        return FilterSpec(fitted.orders, fitted.weights, "refit")
    return registered


# How much further from the goals than the fitted filter a registered filter must read the workload's
# path for the refit to replace it: a horizon near the workload (σ 1.1 declared, σ 1.0 run, ε 5)
# reads some prefixes better and some worse than the fitted filter, 3.5% further at worst, and is
# kept; one at 8.6% (bench/tightness.py: 1.63× after the first round, 1.18× refit) is not.
REFIT_MARGIN = 1.05
# A fitted filter this close to its goals is within them for misses_goals: where the goals cannot all
# hold, the allocation scales them by the least factor that fits (a central job at q = 0.0173, σ 1.177
# by 1.0002), and the registered filter 0.5% over them was kept beside it (seed 26).
REFIT_WITHIN = 1.005
# misses_goals reads every whole unit up to this many, then this many geometric steps (and the path's prefixes).
MISS_POINTS = 2048


def misses_goals(registered: FilterSpec, fitted: FilterSpec | None, unit: np.ndarray, *, offset: np.ndarray | None,
                 units: int, delta: float) -> bool:
    """Whether `registered` reads the workload's path (offset + t units, path_prefixes of `units`: the
    units it buys) above its goals, and `fitted` (where given) within them or REFIT_MARGIN nearer:
    each filter's score is its worst reading ÷ ((1 + goal_excess(t)) × the best order's ε at the
    whole δ) over the prefixes. (Without "within them", a registered filter 0.4% over its goal from a
    tenth on was kept beside a fitted one that met every goal: bench/tightness.py, seed 5.)"""
    if units < 1:
        return False
    # Every whole unit a job may stop at, not only the path's prefixes: a filter fitted to another
    # workload reads this one unevenly, and its worst may lie between two prefixes (a central job at
    # q = 0.0173, σ 1.177 under a declared batch of 256 at σ 1 read 1.155 at step 692 of 2,272, the
    # prefixes none above 1.15, and kept the registered filter: bench/tightness.py, seed 26).
    prefixes = (np.arange(1.0, units + 1) if units <= MISS_POINTS else
                np.unique(np.concatenate([path_prefixes(float(units)), np.round(np.geomspace(1, units, MISS_POINTS))])))
    base = np.zeros(len(unit)) if offset is None else offset
    with np.errstate(invalid="ignore", over="ignore"):
        curves = base[None, :] + np.nan_to_num(prefixes[:, None] * unit[None, :], nan=0.0)
        goals = (1 + goal_excess(prefixes, float(units))) * order_epsilons(
            np.array(rdp.ORDERS)[None, :], curves, np.full((1, 1), delta)).min(axis=1)
        registered_score = float(np.max(read_many(registered, curves, delta=delta) / goals))
        if fitted is None or registered_score <= 1:
            return registered_score > 1
        fitted_score = float(np.max(read_many(fitted, curves, delta=delta) / goals))
    return fitted_score <= REFIT_WITHIN or registered_score > REFIT_MARGIN * fitted_score


def units_bought(spec: FilterSpec, unit: np.ndarray, *, offset: np.ndarray | None, epsilon: float, delta: float) -> int:
    """How many runs of `unit` (after `offset`) the filter approves within ε, one at a time: the
    largest n with its reading of offset + n·unit ≤ ε (0 where the offset alone, or one run, exceeds it)."""
    base = np.zeros(len(unit)) if offset is None else offset

    def fits(n: int) -> bool:
        with np.errstate(invalid="ignore", over="ignore"):
            curve = base + np.nan_to_num(n * unit, nan=0.0)
        return rdp.within_budget(read(spec, curve, delta=delta).epsilon, budget=epsilon)

    if not fits(1):
        return 0
    hi = 2
    while fits(hi) and hi < MAX_UNITS:
        hi *= 2
    lo = hi // 2  # fits(lo) holds, fits(hi) does not (or hi reached MAX_UNITS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def pending_spec(*, epsilon: float, delta: float, dataset_size: int) -> FilterSpec:
    """What a silo with no declared horizon holds until its first charge: δ spread evenly over the
    grid, marked pending. The gate never reads it (its running sum is empty until that charge, which
    is read under first_charge_spec); it is kept so that the row always parses. The budget is still
    checked against the default horizon (a ValueError where no filter could read it: a tiny ε, a δ
    near 1), without allocating that horizon's filter: ~6 ms at every registration of new terms,
    for a filter nothing read; once per distinct (ε, δ, n), as the silos of one consortium share them."""
    refused = _pending_refusal(epsilon, delta, dataset_size)
    if refused is not None:
        raise ValueError(refused)
    return _PENDING


@functools.lru_cache(maxsize=1024)
def _pending_refusal(epsilon: float, delta: float, dataset_size: int) -> str | None:
    """check_allocatable's ValueError for these terms' default horizon, as its text, or None."""
    try:
        check_allocatable(rdp.certified_curve(default_horizon(dataset_size)), epsilon=epsilon, delta=delta)
    except ValueError as error:
        return str(error)
    return None


def scaled(spec: FilterSpec, share: float) -> FilterSpec:
    """The filter on `share` of δ (a plan holds the rest: accounting/plans.py): every weight times
    `share`, rounded down, so that the shares never sum past `share`."""
    if share == 1.0:
        return spec
    return dataclasses.replace(spec, weights=tuple(math.nextafter(w * share, 0.0) for w in spec.weights))


def legacy_spec(orders: Sequence[float] = rdp.ORDERS) -> FilterSpec:
    """The union bound over every order the old rule could approve at, with δ split evenly."""
    return _even(tuple(orders), "legacy")


@functools.lru_cache(maxsize=64)
def _even(orders: tuple[float, ...], source: str) -> FilterSpec:
    # Rounded down, so that the float shares never sum past 1. Cached: every registration of new
    # terms built (and validated) these 156 shares twice, for a filter the gate never reads.
    share = math.nextafter(1.0 / len(orders), 0.0)
    return FilterSpec(orders, tuple([share] * len(orders)), source)


_PENDING = _even(rdp.ORDERS, "pending")

