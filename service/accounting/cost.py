"""What a request's accounting work costs, priced before any of it starts, and a guard that stops
any of it that outruns its price.

dp-accounting's work is not bounded by the size of a request, and any key may send one (a quote
needs no silo key); nothing is written, so the same request can be repeated without limit. So
every route that computes prices its work first, from the mechanism's shape, with what the
computation really does (issues 13, 26 and 46; measured on this dp-accounting, one core of a shared
2-core machine):

- RDP: one curve per distinct leaf, as the curve cache keys it (rdp.py: a leaf's canonical JSON, a
  (q, σ) pair for a Poisson-sampled Gaussian); repeats are free. A new (q, σ) pair ~10–20 ms, a
  Gaussian, Laplace or zCDP leaf ~1–2 ms, a leaf sampled without replacement 0.3–0.6 s, and a
  repeat_and_select or a sampled leaf over a composition what dp-accounting does inside it (every
  node of its event, uncached) on top of its own ~10–50 ms. The tree itself is walked node by node.
- PLD (the reports beside the ledger, and a plan's price): dp-accounting builds one PLD per node
  (no cache), ~2 ms each, on a grid of (its privacy-loss range) / discretisation points: ~1.4 µs a
  point for a Gaussian, ~10 µs for a Poisson-sampled one (its privacy loss is inverted numerically
  point by point, whatever q is: 0.42 s for q 0.9, σ 0.5 at 1e-3, 3.2 s at 1e-4), then convolves it
  into the running one. Memory grows with the grid: 0.9M points 1.9 s and +200 MB, 1.65M points 5 s
  and +570 MB; 400k points ~0.7 s and ~+80 MB.
- Rounds: a rounds quote prices its distinct mechanisms together (their leaves counted once).

A request whose required work is priced over MAX_SECONDS is refused at once (MechanismError, a 422
naming the field, why, and what would fit); optional work (a PLD report, a quote's plan price) is
skipped with its reason where what is left of the request's price does not cover it. The bounds aim
at < 2 s of CPU and < 256 MB on one request.

The guard: `guard()` opens a request's (or a part's) CPU bound on its thread; `tick()`, called
between the steps of every computation (leaf by leaf, PLD node by PLD node, σ search step by step),
stops the computation (a 422, or a skipped report) once its thread's CPU (less its garbage
collections) outruns what was priced: OVERRUN × the admitted price + SLACK, never past
GUARD_SECONDS. It is the σ searches' CPU bound of issue 26, made general.
"""

from __future__ import annotations

import functools
import gc
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from dp_accounting.pld import common
from scipy import stats

from dpledger.service.accounting.events import MechanismError
from dpledger.wire import mechanisms as m

# Below this σ one Gaussian release costs ε in the thousands (RDP α/(2σ²)): no budget the service
# admits (ε ≤ 10^4) is served by it, and dp-accounting's work on it only grows.
MIN_NOISE_MULTIPLIER = 0.01
# One limit on sampled leaves, for charges, quotes, plans and horizons alike: a request may hold at
# most this many distinct sampled leaves (dpsgd, poisson_sampled, sampled_without_replacement); one
# more is refused.
MAX_SAMPLED_LEAVES = 15
_SAMPLED = (m.SampledWithoutReplacement, m.PoissonSampled, m.DpSgd)

# The price of one request: above it the required work is refused before it starts (a 422).
MAX_SECONDS = 1.5
MAX_RDP_SECONDS = MAX_SECONDS  # the name issue 26 gave it
# Optional work (a quote's price of its mechanism as a plan, a PLD at discretization 1e-4 that may
# take ~1.3× its price) runs only while the request's price stays under this, so that a quote with
# all of it stays well under 2 s on a busy machine.
OPTIONAL_SECONDS = 1.0
# The run-time stop: a computation whose thread's CPU outruns OVERRUN × its price + SLACK is stopped
# at its next step, and none runs past GUARD_SECONDS (what the σ searches were already held to).
GUARD_SECONDS = 2.0  # the σ searches' bound of issue 26; the step that crosses it still runs
OVERRUN = 2.0
SLACK = 0.5  # what no price counts: reading the silo, validating, serialising (~1–30 ms)

# RDP: cold seconds of one distinct leaf as the curve cache keys it (its own work; what dp-accounting
# does inside it, uncached, is added from _INNER_SECONDS node by node).
PAIR_SECONDS = 0.02  # a new Poisson-sampled (q, σ) pair, certified (rdp._sampled_gaussian_cached)
# A search (repeat_and_select) over its run's curve: dp-accounting's formula, ~65 ms for a Poisson
# number of runs (a δ read at each order), ~10 ms for the others.
REPEAT_POISSON_SECONDS = 0.08
REPEAT_SECONDS = 0.015
_LEAF_SECONDS: dict[type, float] = {
    m.SampledWithoutReplacement: 0.4, m.PoissonSampled: 0.04,
    m.Gaussian: 0.003, m.Laplace: 0.003, m.ZCdp: 0.003,
}
# Inside a leaf dp-accounting walks every node of its event itself (no cache, a self-composition once).
_INNER_SECONDS: dict[type, float] = {
    m.SampledWithoutReplacement: 0.4, m.RepeatAndSelect: 0.03, m.PoissonSampled: 0.04, m.DpSgd: 0.04,
}
_INNER_CLOSED_FORM = 0.0005  # gaussian, laplace, zcdp inside a leaf
# One filter allocation (filter.allocate: a registration's horizon, the filter a first charge fixes
# or refits; bisections over a dynamic program on the path of its prefixes): 0.01–0.1 s for one
# DP-SGD step, up to ~0.5 s seen; allocate allows it as it starts (a cached filter costs nothing).
FIRST_FILTER_SECONDS = 0.5
NODE_SECONDS = 2e-5  # walking one node of the tree (rdp.rdp_curve's recursion, this walk)
MAX_NODES = 10_000  # nodes of the mechanism tree walked; far beyond any plan a person writes

# PLD: the grid, in points at discretization 1 (divide by the discretization).
MAX_PLD_POINTS = 400_000
MAX_MEMORY_BYTES = 256 * 1024**2
PLD_BYTES_PER_POINT = 250.0  # measured: +200 MB at 0.9M points, +570 MB at 1.65M (FFT buffers)
PLD_NODE_SECONDS = 0.0025  # one PLD built and composed, whatever its grid (1,000 Gaussians at σ 2000: 1.9 s)
# Building one point of the grid (a sampled step's: both its add and remove sides, 6.3 µs each, measured).
_POINT_SECONDS = {"gaussian": 2e-6, "sampled": 1.4e-5, "laplace": 2e-6}
CONVOLVE_POINT_SECONDS = 1e-7  # per point of the running PLD each composition convolves
_PLD_TRUNCATION = -50.0  # dp-accounting's default log_mass_truncation_bound
# PLD self-composition: a leaf's "work" ~ compositions × privacy-loss range (1/σ², 1/b, scaled by q).
# Measured: work 2.5·10^4 took 1–2.4 s and ~900 MB; the bound keeps the report well under that.
MAX_PLD_WORK = 2_000.0
# The discretization of the PLD report those measurements were taken at: a finer one (a plan's
# price) does proportionally more work for the same mechanism.
MEASURED_DISCRETIZATION = 1e-3
MIN_PLD_NOISE_MULTIPLIER = 0.5  # a lone Gaussian at σ = 0.05 needed ~160 MB already
MIN_PLD_LAPLACE_SCALE = 0.1  # a lone Laplace at b = 0.001 took 3.6 s
MAX_PLD_LEAVES = 8

_KIND_NAMES: dict[type, str] = {
    m.SampledWithoutReplacement: "sampled-without-replacement leaves", m.RepeatAndSelect: "repeat_and_select leaves",
    m.PoissonSampled: "Poisson-sampled leaves", m.DpSgd: "new Poisson-sampled (q, σ) pairs",
}


@dataclass
class Estimate:
    """A mechanism's (or a request's) accounting work, before any of it runs."""

    nodes: int = 0
    leaves: dict[str, float] = field(default_factory=dict)  # distinct leaf (cache key) → cold RDP seconds
    leaf_types: dict[str, type] = field(default_factory=dict)
    pld_skip: str | None = None
    # Each PLD the accountant would build, in order: (kind, its noise, q, its count); priced lazily
    # (pld_grid), when a PLD report is weighed (pld_reason).
    pld_parts: list[tuple[str, float, float, float]] = field(default_factory=list)
    pld_work: float = 0.0  # as measured at MEASURED_DISCRETIZATION
    pld_leaves: set[str] = field(default_factory=set)

    @property
    def pld_nodes(self) -> int:
        return len(self.pld_parts)

    @functools.cached_property
    def pld_grid(self) -> tuple[float, float, float]:
        """(grid points, seconds building them, Σ running grid convolved), all at discretization 1."""
        points = build = convolve = 0.0
        for kind, noise, q, count in self.pld_parts:
            if kind == "gaussian":
                loss_range = gaussian_loss_range(noise / math.sqrt(count))
            elif kind == "laplace":
                loss_range = 2.0 / noise
            else:
                loss_range = sampled_loss_range(noise, q)
            points += loss_range
            build += loss_range * _POINT_SECONDS[kind]
            convolve += points
        return points, build, convolve

    @property
    def rdp_seconds(self) -> float:
        return math.fsum(self.leaves.values()) + self.nodes * NODE_SECONDS

    @property
    def sampled(self) -> int:
        return sum(1 for kind in self.leaf_types.values() if kind in _SAMPLED)

    def merge(self, other: Estimate) -> None:
        """Adds another mechanism of the same request: its leaves count once across both (the
        curve cache computes each once), its PLD work adds up."""
        self.nodes += other.nodes
        self.leaves.update(other.leaves)
        self.leaf_types.update(other.leaf_types)

    def pld_seconds(self, discretization: float) -> float:
        _, build, convolve = self.pld_grid
        return self.pld_nodes * PLD_NODE_SECONDS + (build + CONVOLVE_POINT_SECONDS * convolve) / discretization

    def pld_reason(self, discretization: float, *, seconds_left: float, budget: float = MAX_SECONDS) -> str | None:
        """Why the PLD at this discretization may not run within `seconds_left`, or None."""
        if self.pld_skip is not None:
            return self.pld_skip
        if len(self.pld_leaves) > MAX_PLD_LEAVES:
            return f"more than {MAX_PLD_LEAVES} distinct leaves"
        points = self.pld_grid[0] / discretization
        if points > MAX_PLD_POINTS:
            return (f"its privacy loss needs a grid of {points:.3g} points at discretization {discretization:g} "
                    f"(at most {MAX_PLD_POINTS:,}: ~2 s and ~256 MB of work beyond)")
        work = self.pld_work * MEASURED_DISCRETIZATION / discretization
        if work > MAX_PLD_WORK:
            return ("the compositions would need more memory and time than one request may use "
                    f"(work {work:.3g} > {MAX_PLD_WORK:g})")
        seconds = self.pld_seconds(discretization)
        if seconds > seconds_left:
            return (f"dp-accounting would build {self.pld_nodes} privacy loss distribution(s) at discretization "
                    f"{discretization:g}, about {seconds:.2g} s of CPU, where {max(seconds_left, 0.0):.2g} s of this "
                    f"request's {budget:g} s are left")
        return None


def estimate(mechanism: m.AnyMechanism, *, path: str = "mechanism") -> Estimate:
    """The mechanism's work, priced from its shape alone; MechanismError where its shape is refused
    whatever its price (too many nodes, a noise below the floor)."""
    walk = Estimate()
    _visit(mechanism, walk, count=1.0, path=path)
    return walk


def check(
    mechanism: m.AnyMechanism, *, path: str = "mechanism", pld_discretization: float = MEASURED_DISCRETIZATION,
    warm: bool = True,
    budget: float = MAX_SECONDS,
) -> str | None:
    """Refuses (MechanismError) a mechanism whose RDP work, with what this request has already
    admitted, exceeds one request's price; admits it to the request's guard; returns why its PLD
    report (at `pld_discretization`) must be skipped within what is left, or None.

    `budget`: what the request's price may reach with this PLD (OPTIONAL_SECONDS for work a quote
    only adds beside its answer). `warm`: compute the distinct leaves' curves now, one at a time
    under the guard (the same cached calls the whole curve then reads back), so that a leaf that
    outruns its price stops the request before the next one starts."""
    walk = estimate(mechanism, path=path)
    admitted = _admitted_leaves()
    new = {key: s for key, s in walk.leaves.items() if key not in admitted}
    refuse_rdp(walk, path=path, already=_admitted_seconds(), new=new)
    admit(math.fsum(new.values()) + walk.nodes * NODE_SECONDS, leaves=new)
    reason = walk.pld_reason(pld_discretization, seconds_left=budget - _admitted_seconds(), budget=budget)
    if warm:
        _warm(mechanism, walk)
    return None if reason is None else f"PLD report skipped: {reason}"


def refuse_rdp(walk: Estimate, *, path: str, already: float = 0.0, new: dict[str, float] | None = None) -> None:
    """MechanismError where the mechanism's RDP work (its new leaves, beside `already` admitted
    seconds of the same request) exceeds the price of one request, saying what would fit."""
    sampled = walk.sampled
    if sampled > MAX_SAMPLED_LEAVES:
        raise MechanismError(
            path, f"has {sampled} distinct sampled leaves; one request may hold at most {MAX_SAMPLED_LEAVES}: "
            "split it into several charges, or reuse leaves",
        )
    leaves = walk.leaves if new is None else new
    seconds = already + math.fsum(leaves.values()) + walk.nodes * NODE_SECONDS
    if seconds > MAX_SECONDS:
        raise MechanismError(path, f"would cost dp-accounting about {seconds:.1f} s of CPU ({_breakdown(walk, leaves)}"
                                   f"{'' if already == 0 else f', beside {already:.2g} s this request priced before'}); "
                                   f"one request may cost at most {MAX_SECONDS:g} s: {_what_fits(walk, leaves)}")


def _breakdown(walk: Estimate, leaves: dict[str, float]) -> str:
    kinds: dict[type, list[float]] = {}
    for key, seconds in leaves.items():
        kinds.setdefault(walk.leaf_types[key], []).append(seconds)
    parts = [f"{len(found)} distinct {_KIND_NAMES.get(kind, kind.__name__.lower() + ' leaves')} at ~{max(found):.2g} s"
             for kind, found in sorted(kinds.items(), key=lambda item: -math.fsum(item[1]))]
    if walk.nodes * NODE_SECONDS >= 0.05:
        parts.append(f"{walk.nodes:,} nodes to walk")
    return ", ".join(parts) or "its nodes"


def _what_fits(walk: Estimate, leaves: dict[str, float]) -> str:
    if not leaves:
        return f"at most ~{int(MAX_SECONDS / NODE_SECONDS):,} nodes fit"
    dearest = max(leaves, key=lambda key: leaves[key])
    kind = walk.leaf_types[dearest]
    fit = max(int(MAX_SECONDS / leaves[dearest]), 0)
    return (f"at most {fit} such {_KIND_NAMES.get(kind, kind.__name__.lower() + ' leaves')} fit in one request: "
            "split it into several requests, or reuse leaves (a repeated leaf costs nothing more)")


def _visit(mechanism: m.AnyMechanism, walk: Estimate, *, count: float, path: str) -> None:
    walk.nodes += 1
    if walk.nodes > MAX_NODES:
        raise MechanismError(path, f"has more than {MAX_NODES} parts; one request may hold at most that many")
    match mechanism:
        case m.SelfComposed(count=n, event=inner):
            _visit(inner, walk, count=count * n, path=f"{path}.event")
            return
        case m.Composed(events=events):
            for i, event in enumerate(events):
                _visit(event, walk, count=count, path=f"{path}.events.{i}")
            return
        case m.Gaussian(noise_multiplier=sigma):
            _noise_floor(sigma, path=f"{path}.noise_multiplier")
            walk.pld_parts.append(("gaussian", sigma, 1.0, count))
        case m.DpSgd(noise_multiplier=sigma, sampling_rate=q, steps=steps):
            _noise_floor(sigma, path=f"{path}.noise_multiplier")
            _pld_gaussian(walk, sigma=sigma, q=q or 1.0, count=count * steps)
        case m.Laplace(noise_multiplier=b):
            if b < MIN_PLD_LAPLACE_SCALE:
                walk.pld_skip = walk.pld_skip or f"Laplace scale {b!r} < {MIN_PLD_LAPLACE_SCALE}"
            walk.pld_work += count / b
            walk.pld_parts.append(("laplace", b, 1.0, count))
        case m.PoissonSampled(sampling_rate=q, event=m.Gaussian(noise_multiplier=sigma)):
            _noise_floor(sigma, path=f"{path}.event.noise_multiplier")
            _pld_gaussian(walk, sigma=sigma, q=q or 1.0, count=count)
        case m.RepeatAndSelect(event=inner):
            # A search's curve is a formula over its run's curve (rdp.repeat_and_select): the run's
            # leaves are cached leaves like any other (priced once across the request), the
            # formula has its own price; the PLD accountant supports none of it.
            run = Estimate(nodes=walk.nodes)
            _visit(inner, run, count=1.0, path=f"{path}.event")
            walk.nodes = run.nodes
            walk.leaves.update(run.leaves)
            walk.leaf_types.update(run.leaf_types)
        case _:
            for child in m.children(mechanism):  # one `event` each: Composed was handled above
                _visit_inner(child, walk, path=f"{path}.event")
    key = _leaf_key(mechanism)
    walk.pld_leaves.add(key)
    if key not in walk.leaves:
        walk.leaves[key] = _leaf_seconds(mechanism)
        walk.leaf_types[key] = type(mechanism)


def _leaf_key(mechanism: m.AnyMechanism) -> str:
    """The curve cache's key of a leaf: its (q, σ) pair for a Poisson-sampled Gaussian, whatever its
    steps (rdp._sampled_gaussian_cached), else its JSON (rdp._leaf_curve_cached)."""
    match mechanism:
        case m.DpSgd(sampling_rate=q, noise_multiplier=sigma) | m.PoissonSampled(
                sampling_rate=q, event=m.Gaussian(noise_multiplier=sigma)):
            return f"pair:{q!r}:{sigma!r}"
    return mechanism.model_dump_json()


def _leaf_seconds(mechanism: m.AnyMechanism) -> float:
    if isinstance(mechanism, m.DpSgd) or (
            isinstance(mechanism, m.PoissonSampled) and isinstance(mechanism.event, m.Gaussian)):
        return PAIR_SECONDS
    if isinstance(mechanism, m.RepeatAndSelect):  # its run's leaves are priced on their own (_visit)
        return REPEAT_POISSON_SECONDS if mechanism.shape == "infinity" else REPEAT_SECONDS
    own = _LEAF_SECONDS.get(type(mechanism), _INNER_CLOSED_FORM)
    return own + math.fsum(_inner_seconds(child) for child in m.children(mechanism))


def _inner_seconds(mechanism: m.AnyMechanism) -> float:
    """dp-accounting's own walk of an event inside a leaf: every node, a self-composition once."""
    own = _INNER_SECONDS.get(type(mechanism), _INNER_CLOSED_FORM if not m.children(mechanism) else 0.0)
    return own + math.fsum(_inner_seconds(child) for child in m.children(mechanism))


def _visit_inner(mechanism: m.AnyMechanism, walk: Estimate, *, path: str) -> None:
    """The nodes inside a leaf: counted against MAX_NODES and the noise floor, priced with the leaf;
    the PLD accountant supports none of the leaves that hold them (its report says so)."""
    walk.nodes += 1
    if walk.nodes > MAX_NODES:
        raise MechanismError(path, f"has more than {MAX_NODES} parts; one request may hold at most that many")
    match mechanism:
        case m.Gaussian(noise_multiplier=sigma) | m.DpSgd(noise_multiplier=sigma):
            _noise_floor(sigma, path=f"{path}.noise_multiplier")
    for i, child in enumerate(m.children(mechanism)):
        _visit_inner(child, walk, path=f"{path}.events.{i}" if isinstance(mechanism, m.Composed) else f"{path}.event")


def _noise_floor(sigma: float, *, path: str) -> None:
    if sigma < MIN_NOISE_MULTIPLIER:
        raise MechanismError(
            path,
            f"must be at least {MIN_NOISE_MULTIPLIER}: below it one release costs ε beyond any budget the service "
            f"admits, and accounting it costs memory that grows as 1/σ². Found {sigma!r}.",
        )


def _pld_gaussian(walk: Estimate, *, sigma: float, q: float, count: float) -> None:
    if sigma < MIN_PLD_NOISE_MULTIPLIER:
        walk.pld_skip = walk.pld_skip or f"noise multiplier {sigma!r} < {MIN_PLD_NOISE_MULTIPLIER}"
    walk.pld_work += count * q / sigma / sigma  # not sigma**2: that overflows for σ near the float maximum
    # At q = 1 a Gaussian's, in closed form; else each point of its grid is found numerically.
    walk.pld_parts.append(("sampled", sigma, q, count) if q < 1 else ("gaussian", sigma, 1.0, 1.0))


@functools.lru_cache(maxsize=4096)
def sampled_loss_range(sigma: float, q: float) -> float:
    """The privacy-loss range of dp-accounting's PLD of one Poisson-sampled Gaussian step: its grid has
    this / discretisation points a side (~3.8 at q 0.004, σ 1.1; 28 at q 0.999, σ 0.5), at most the
    Gaussian's. dp-accounting's own truncation points and privacy loss, in its own arithmetic
    (GaussianPrivacyLoss.privacy_loss_tail and privacy_loss, remove adjacency, sensitivity 1), bit for
    bit: not its object, whose scipy distribution cost ~1–2 ms to build for every new (q, σ) pair."""
    try:
        x = sigma * _standard_ppf()  # its ppf at 0.5·e^truncation, at scale σ
        return float(_remove_loss(x - 1, sigma, q) - _remove_loss(-x, sigma, q))
    except (ArithmeticError, ValueError):  # extreme σ: the Gaussian's bounds it
        return gaussian_loss_range(sigma)


def _remove_loss(x: float, sigma: float, q: float) -> float:
    """dp-accounting's privacy loss of the sampled Gaussian at x (remove adjacency, sensitivity 1)."""
    unsampled = (-0.5 - x) / (sigma**2)
    return unsampled if q == 1.0 else common.log_a_times_exp_b_plus_c(q, unsampled, 1 - q)


@functools.cache
def _standard_ppf() -> float:
    """dp-accounting's lower truncation point of a standard normal: its ppf at 0.5·e^truncation."""
    return float(stats.norm.ppf(0.5 * math.exp(_PLD_TRUNCATION)))


def gaussian_loss_range(sigma: float) -> float:
    """The privacy-loss range dp-accounting's PLD of a Gaussian at σ (sensitivity 1) spans: its grid
    has this / discretisation points. dp-accounting truncates the noise at z·σ on either side (e^-50
    of its mass), so the loss spans (2zσ + 1)/σ² = 2z/σ + 1/σ² (~19.5/σ + 1/σ²), exactly its own
    value (to the last bit or two); z is its truncation point, read once (a hostile request holds
    thousands of σ)."""
    return -2 * _standard_ppf() / sigma + 1 / sigma / sigma  # not sigma**2: that overflows near the float maximum


def _warm(mechanism: m.AnyMechanism, walk: Estimate) -> None:
    """Each distinct leaf's curve computed on its own, a tick between: the calls the whole curve
    makes next, which then only read the cache. Nothing to interleave with one leaf."""
    if len(walk.leaves) < 2:
        return
    from dpledger.service.accounting import rdp  # here: rdp imports this module's callers, not this module

    for leaf in _distinct_leaves(mechanism):
        rdp.certified_curve(leaf)
        tick()


def _distinct_leaves(mechanism: m.AnyMechanism, seen: set[str] | None = None) -> Iterator[m.AnyMechanism]:
    """Each distinct leaf once, in order; a search's run's leaves before the search itself."""
    seen = set() if seen is None else seen
    if isinstance(mechanism, m.SelfComposed):
        yield from _distinct_leaves(mechanism.event, seen)
    elif isinstance(mechanism, m.Composed):
        for event in mechanism.events:
            yield from _distinct_leaves(event, seen)
    else:
        if isinstance(mechanism, m.RepeatAndSelect):
            yield from _distinct_leaves(mechanism.event, seen)
        key = _leaf_key(mechanism)
        if key not in seen:
            seen.add(key)
            yield mechanism



# --- the guard ---------------------------------------------------------------------------------


class Overrun(Exception):
    """A computation outran its guard (deliberately no ValueError: the accountants' and the σ
    searches' own error handling must not catch it)."""

    def __init__(self, guard: Guard, spent: float) -> None:
        super().__init__(f"{guard.where}: stopped after {spent:.2f} s of CPU")
        self.guard = guard
        self.spent = spent


class Stopped(MechanismError):
    """A 422: the computation was stopped at its guard (what an Overrun becomes where its guard ends)."""

    def __init__(self, field: str, message: str, *, spent: float) -> None:
        super().__init__(field, message)
        self.spent = spent


@dataclass
class Guard:
    where: str  # the field a stop names
    started: float
    thread: int
    seconds: float | None  # a fixed allowance; None: OVERRUN × the admitted price + slack
    slack: float = SLACK
    admitted: float = 0.0
    leaves: set[str] = field(default_factory=set)
    allowed: float = 0.0  # work that runs but that no price counts (allow)

    def allowance(self) -> float:
        if self.seconds is not None:
            return self.seconds
        return min(GUARD_SECONDS, OVERRUN * (self.admitted + self.allowed) + self.slack)


_GUARDS: ContextVar[tuple[Guard, ...]] = ContextVar("dpledger_cost_guards", default=())
# The CPU a guard counts is its thread's less the garbage collections run on it: a collection is the
# process's housekeeping, as long as the whole heap and triggered by whichever thread allocates next
# (a full one over a large process took ~1 s on CI, stopping a 0.1 s request as an overrun).
_COLLECTING = threading.local()


def _collection(phase: str, _info: dict[str, int]) -> None:
    if phase == "start":
        _COLLECTING.started = time.thread_time()
    elif (started := getattr(_COLLECTING, "started", None)) is not None:
        _COLLECTING.seconds = getattr(_COLLECTING, "seconds", 0.0) + time.thread_time() - started
        _COLLECTING.started = None


gc.callbacks.append(_collection)


def _working() -> float:
    """This thread's CPU seconds, less those its garbage collections took."""
    return time.thread_time() - getattr(_COLLECTING, "seconds", 0.0)
PART_SLACK = 0.1  # a part (a PLD report, a plan's price) is timed alone: only its own steps


def _active() -> tuple[Guard, ...]:
    ident = threading.get_ident()
    return tuple(g for g in _GUARDS.get() if g.thread == ident)


@contextmanager
def guard(
    field: str, *, seconds: float | None = None, price: float = 0.0, slack: float = SLACK, message: str | None = None,
) -> Iterator[Guard]:
    """The CPU bound of a request (outermost) or of a part of one, on this thread: `seconds`, a fixed
    allowance, or else OVERRUN × what is admitted to it (`price`, then `admit`) + `slack`, never past
    GUARD_SECONDS. Either is admitted to the guards around it. An overrun of this guard leaves it as
    Stopped (a 422 naming `field`; `message` says why); an overrun of an enclosing one passes through."""
    admit(seconds if seconds is not None else price)
    made = Guard(field, _working(), threading.get_ident(), seconds, slack, admitted=price)
    token = _GUARDS.set((*_GUARDS.get(), made))
    try:
        yield made
    except Overrun as error:
        if error.guard is not made:
            raise
        why = message or (f"was stopped after {error.spent:.2f} s of CPU, past what its work was priced at "
                          f"({made.admitted:.2g} s; one request may cost at most {GUARD_SECONDS:g} s)")
        raise Stopped(field, why, spent=error.spent) from None
    finally:
        _GUARDS.reset(token)


def admit(seconds: float, *, leaves: dict[str, float] | None = None) -> None:
    """Adds priced work to every guard open on this thread (a part's work is its request's too)."""
    for open_guard in _active():
        open_guard.admitted += seconds
        if leaves:
            open_guard.leaves.update(leaves)


def allow(seconds: float) -> None:
    """Widens every guard open on this thread by work that runs but that no price counts (a filter's
    allocation): never counted against what a request may price, nor against its optional reports."""
    for open_guard in _active():
        open_guard.allowed += seconds


def _admitted_seconds() -> float:
    found = _active()
    return found[0].admitted if found and found[0].seconds is None else 0.0


def _admitted_leaves() -> set[str]:
    found = _active()
    return found[0].leaves if found else set()


def tick() -> None:
    """Between two steps of any computation: stops it (Overrun) where its thread's CPU has outrun a
    guard open on this thread, the innermost first (a part past its own bound is stopped with its own
    reason, a σ search's or a skipped report's; a request past its bound stops whatever part runs)."""
    found = _active()
    if not found:
        return
    now = _working()
    for open_guard in reversed(found):
        spent = now - open_guard.started
        if spent > open_guard.allowance():
            raise Overrun(open_guard, spent)
