"""What a request's accounting work costs, estimated before any of it starts.

dp-accounting's work is not bounded by the size of a request: a sampled-without-replacement leaf
costs its RDP accountant ~250 ms (a new Poisson-sampled pair a few ms, sampled_gaussian.py), and the
PLD accountant's time and memory grow with its grid: (the privacy-loss range) / discretisation
points, ~2·9.8/σ + 1/σ² for a Gaussian at σ (k releases of one are a Gaussian at σ/√k), and for a
sampled leaf with the number of its compositions. Any key may call the quote route, and a quote,
a plan, a horizon and a charge cost the same work each time they are sent (nothing is written), so
each is priced here first, from the mechanism's shape (its distinct leaves, their counts, σ, and
the PLD's discretisation), measured on this dp-accounting on one core of a shared 2-core machine
(issues 13 and 26): RDP work over its bound is refused with a 422 naming the field and the reason,
a PLD over its bound is skipped with its reason (a report) or refused (a plan). The bounds aim at
< 2 s of CPU and < 256 MB on one request, the PLD included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dp_accounting.pld import privacy_loss_mechanism

from dpledger.service.accounting.events import MechanismError
from dpledger.wire import mechanisms as m

# Below this σ one Gaussian release costs ε in the thousands (RDP α/(2σ²)): no budget the service
# admits (ε ≤ 10^4) is served by it, and dp-accounting's work on it only grows.
MIN_NOISE_MULTIPLIER = 0.01
# One limit on sampled leaves, for charges, quotes, plans and horizons alike: a request may hold at
# most this many distinct sampled leaves (dpsgd, poisson_sampled, sampled_without_replacement); one
# more is refused. A new Poisson-sampled pair costs ~10 ms (sampled_gaussian.py, reference_curve.py), but a leaf
# sampled without replacement still costs dp-accounting ~250 ms: the seconds below bound those.
MAX_SAMPLED_LEAVES = 15
_SAMPLED = (m.SampledWithoutReplacement, m.PoissonSampled, m.DpSgd)
# Estimated seconds of RDP work per distinct leaf (the curve cache makes repeats free).
_RDP_SECONDS = {m.SampledWithoutReplacement: 0.3, m.PoissonSampled: 0.01, m.DpSgd: 0.01, m.RepeatAndSelect: 0.05}
_RDP_SECONDS_CLOSED_FORM = 0.001  # gaussian, laplace, zcdp: a formula per order
MAX_RDP_SECONDS = 1.5
# PLD of Gaussians: dp-accounting builds one Gaussian PLD per Gaussian leaf at σ/√(its count) (k
# releases of a Gaussian are one Gaussian at σ/√k, exactly), on a grid of (its privacy-loss range) /
# discretisation points, the range from dp-accounting's own truncation of the noise (e^-50 of mass).
# Measured (issue 26): 0.9M points 1.9 s and +200 MB, 1.65M points 5 s and +570 MB (self_composed(400,
# gaussian σ 2.0) = σ 0.1 at the plan's 1e-4); 400k points ~0.7 s and ~+80 MB.
MAX_PLD_POINTS = 400_000
_PLD_TRUNCATION = -50.0  # dp-accounting's default log_mass_truncation_bound
MAX_NODES = 10_000  # nodes of the mechanism tree walked; far beyond any plan a person writes

# PLD: a leaf's "work" ~ compositions × privacy-loss range (1/σ², 1/b, scaled by q for sampling).
# Measured: work 2.5·10^4 took 1–2.4 s and ~900 MB; the bound keeps the report well under that.
MAX_PLD_WORK = 2_000.0
# The discretization of the PLD report those measurements were taken at: a finer one (a plan's
# price) does proportionally more work for the same mechanism.
MEASURED_DISCRETIZATION = 1e-3
MIN_PLD_NOISE_MULTIPLIER = 0.5  # a lone Gaussian at σ = 0.05 needed ~160 MB already
MIN_PLD_LAPLACE_SCALE = 0.1  # a lone Laplace at b = 0.001 took 3.6 s
MAX_PLD_LEAVES = 8


@dataclass
class _Walk:
    nodes: int = 0
    leaves: dict[str, float] = field(default_factory=dict)  # distinct leaf JSON → estimated RDP seconds
    pld_work: float = 0.0
    pld_points: float = 0.0  # the Gaussian leaves' grid points at discretization 1
    leaf_types: dict[str, type] = field(default_factory=dict)
    pld_skip: str | None = None


def check(
    mechanism: m.AnyMechanism, *, path: str = "mechanism", pld_discretization: float = MEASURED_DISCRETIZATION
) -> str | None:
    """Refuses (MechanismError) a mechanism whose RDP work exceeds the bound; returns why its PLD
    report (at `pld_discretization`) must be skipped, or None where that work is within bounds too."""
    walk = _Walk()
    _visit(mechanism, walk, count=1.0, path=path)
    walk.pld_work *= MEASURED_DISCRETIZATION / pld_discretization
    sampled = sum(1 for leaf_type in walk.leaf_types.values() if leaf_type in _SAMPLED)
    if sampled > MAX_SAMPLED_LEAVES:
        raise MechanismError(
            path, f"has {sampled} distinct sampled leaves; one request may hold at most {MAX_SAMPLED_LEAVES}: "
            "split it into several charges, or reuse leaves",
        )
    seconds = math.fsum(walk.leaves.values())
    if seconds > MAX_RDP_SECONDS:
        raise MechanismError(
            path,
            f"would cost dp-accounting about {seconds:.1f} s of CPU ({len(walk.leaves)} distinct sampled leaves); "
            f"one request may cost at most {MAX_RDP_SECONDS} s: split it into several charges, or reuse leaves",
        )
    if walk.pld_skip is None and len(walk.leaves) > MAX_PLD_LEAVES:
        walk.pld_skip = f"more than {MAX_PLD_LEAVES} distinct leaves"
    points = walk.pld_points / pld_discretization
    if walk.pld_skip is None and points > MAX_PLD_POINTS:
        walk.pld_skip = (
            f"its Gaussian privacy loss needs a grid of {points:.3g} points at discretization {pld_discretization:g} "
            f"(at most {MAX_PLD_POINTS:,}: ~2 s and ~256 MB of work beyond)"
        )
    if walk.pld_skip is None and walk.pld_work > MAX_PLD_WORK:
        walk.pld_skip = (
            "the compositions would need more memory and time than one request may use "
            f"(work {walk.pld_work:.3g} > {MAX_PLD_WORK:g})"
        )
    return None if walk.pld_skip is None else f"PLD report skipped: {walk.pld_skip}"


def _visit(mechanism: m.AnyMechanism, walk: _Walk, *, count: float, path: str) -> None:
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
            walk.pld_points += gaussian_loss_range(sigma / math.sqrt(count))
        case m.DpSgd(noise_multiplier=sigma, sampling_rate=q, steps=steps):
            _noise_floor(sigma, path=f"{path}.noise_multiplier")
            _pld_gaussian(walk, sigma=sigma, q=q or 1.0, count=count * steps)
        case m.Laplace(noise_multiplier=b):
            if b < MIN_PLD_LAPLACE_SCALE:
                walk.pld_skip = walk.pld_skip or f"Laplace scale {b!r} < {MIN_PLD_LAPLACE_SCALE}"
            walk.pld_work += count / b
        case m.PoissonSampled(sampling_rate=q, event=m.Gaussian(noise_multiplier=sigma)):
            _noise_floor(sigma, path=f"{path}.event.noise_multiplier")
            _pld_gaussian(walk, sigma=sigma, q=q or 1.0, count=count)
        case _:
            for child in m.children(mechanism):  # one `event` each: Composed was handled above
                _visit(child, walk, count=count, path=f"{path}.event")
    key = mechanism.model_dump_json()
    if key not in walk.leaves:
        walk.leaves[key] = _RDP_SECONDS.get(type(mechanism), _RDP_SECONDS_CLOSED_FORM)
        walk.leaf_types[key] = type(mechanism)


def _noise_floor(sigma: float, *, path: str) -> None:
    if sigma < MIN_NOISE_MULTIPLIER:
        raise MechanismError(
            path,
            f"must be at least {MIN_NOISE_MULTIPLIER}: below it one release costs ε beyond any budget the service "
            f"admits, and accounting it costs memory that grows as 1/σ². Found {sigma!r}.",
        )


def _pld_gaussian(walk: _Walk, *, sigma: float, q: float, count: float) -> None:
    if sigma < MIN_PLD_NOISE_MULTIPLIER:
        walk.pld_skip = walk.pld_skip or f"noise multiplier {sigma!r} < {MIN_PLD_NOISE_MULTIPLIER}"
    walk.pld_work += count * q / sigma / sigma  # not sigma**2: that overflows for σ near the float maximum


def gaussian_loss_range(sigma: float) -> float:
    """The privacy-loss range dp-accounting's PLD of a Gaussian at σ (sensitivity 1) spans: its grid
    has this / discretisation points. ~2·9.8/σ + 1/σ² (the noise truncated at e^-50 of mass)."""
    try:
        loss = privacy_loss_mechanism.GaussianPrivacyLoss(sigma, log_mass_truncation_bound=_PLD_TRUNCATION)
        tail = loss.privacy_loss_tail()
        return float(loss.privacy_loss(tail.lower_x_truncation) - loss.privacy_loss(tail.upper_x_truncation))
    except OverflowError:  # σ near the float range: dp-accounting squares it; the range is ~0 there
        return 2 * 10.0 / sigma + 1 / sigma / sigma
