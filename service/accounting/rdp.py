"""RDP curves of mechanisms at a fixed order grid, their composition, and (ε, δ) read off them.

Composition in RDP is addition of curves, so a ledger keeps a running sum and an approval costs
O(number of orders), never O(history) (docs/ARCHITECTURE.md, "The safety invariant"). Every curve comes from
`dp_accounting.rdp.RdpAccountant`; this module only caches and adds them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from importlib.metadata import version

import numpy as np
from dp_accounting import privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import conversion, reference_curve, sampled_gaussian
from dpledger.service.accounting.events import MechanismError, to_dp_event
from dpledger.wire.mechanisms import (
    AnyMechanism,
    Composed,
    DpSgd,
    Gaussian,
    PoissonSampled,
    RepeatAndSelect,
    SampledWithoutReplacement,
    SelfComposed,
    children,
)

# dp-accounting logs a warning and returns ∞ (a safe bound) at orders where its series does not
# converge; a ledger asks for such curves routinely, and RunningSum handles the ∞ entries exactly.
logging.getLogger("absl").setLevel(logging.ERROR)

ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)
_ORDERS_ARRAY = np.array(ORDERS)

# Stored with every charge so a history can be reproduced after a library upgrade.
ORDER_GRID_ID = "dp_accounting.DEFAULT_RDP_ORDERS:" + hashlib.sha256(json.dumps(ORDERS).encode()).hexdigest()[:16]
CONVERSION_ID = f"dp_accounting.rdp.compute_epsilon@{version('dp-accounting')}"
# What the ledger stores since the proven gate: curves from certified_curve (fractional orders of
# Poisson-sampled Gaussians certified, see fractional.py), converted by the silo's union-bound
# filter (filter.py) with dp-accounting's per-order conversion.
LEDGER_CONVERSION_ID = f"dpledger.filter.union_bound+certified_fractional@{version('dp-accounting')}"

# The cache holds one curve per distinct leaf mechanism (a (q, σ) pair for DP-SGD): computing one
# costs dp-accounting 50–65 ms (the ledger's certified curve, dp-accounting's values included, ~9 ms),
# and a training job repeats the same pair every round.
CACHE_SIZE = 4096


@dataclass(frozen=True)
class Guarantee:
    epsilon: float
    order: float
    rho: float | None


def rdp_curve(mechanism: AnyMechanism, *, certified: bool = False) -> np.ndarray:
    """The mechanism's RDP at every order of ORDERS (a fresh array the caller may keep).

    `certified`: every Poisson-sampled Gaussian (a DP-SGD step) is charged sampled_gaussian.curve_upper:
    at every order a proven upper bound within 1e-6 of the exact divergence (integer orders within
    ~1e-13 of dp-accounting's own values, fractional ones tighter than dp-accounting's by up to 35%),
    and dp-accounting's value beside it where that bound is not tight."""
    match mechanism:
        case SelfComposed(count=count, event=inner):
            return times(count, rdp_curve(inner, certified=certified), up=certified)
        case Composed(events=events):
            total: np.ndarray = np.sum([rdp_curve(e, certified=certified) for e in events], axis=0)
            # The ledger's sum of n non-negative terms rounded to nearest: n ulps above it bound the
            # exact sum (dp-accounting's reference, certified=False, is its own float arithmetic).
            return rounded_up(total, len(events)) if certified else total
        case DpSgd(sampling_rate=q, noise_multiplier=sigma, steps=steps):
            if q is None:
                raise MechanismError("mechanism.batch_size", "needs a silo's dataset_size; give sampling_rate or silo_id")
            return times(steps, _sampled_gaussian(q, sigma, certified=certified), up=certified)
        case PoissonSampled(sampling_rate=float() as q, event=Gaussian(noise_multiplier=sigma)) if certified:
            return _sampled_gaussian(q, sigma, certified=True)
        case RepeatAndSelect(event=inner, mean=mean) if certified:
            run = tuple(rdp_curve(inner, certified=True).tolist())
            return np.array(_repeat_and_select_cached(run, mean, mechanism.shape_value))
    return _leaf_curve(mechanism.model_dump_json())


# dp-accounting's float sums inside its bound can move it by a few ulps; this pads past them.
_REPEAT_PAD = 1e-12


@functools.lru_cache(maxsize=CACHE_SIZE)
def _repeat_and_select_cached(run: tuple[float, ...], mean: float, shape: float) -> tuple[float, ...]:
    return tuple(repeat_and_select(np.array(run), mean=mean, shape=shape).tolist())


def repeat_and_select(run: np.ndarray, *, mean: float, shape: float) -> np.ndarray:
    """A search's curve: K runs (K random, of this mean and shape), the best one released, over the
    certified curve of one run. dp-accounting's formula (Papernot & Steinke 2022, Theorems 2 and 6)
    is increasing in the run's curve, so an upper bound in gives an upper bound out; its accountant
    applies it only to its own float curve of the run (uncached: 0.1–0.4 s for one DP-SGD step),
    where this reads the run's certified, cached curves and costs 10–65 ms."""
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = np.asarray(rdp_lib._compute_rdp_repeat_and_select(list(ORDERS), run, mean, shape), dtype=float)
    except (ValueError, ArithmeticError) as error:
        raise MechanismError("mechanism", f"dp-accounting refused it: {error}") from error
    out = np.where(np.isnan(out), np.inf, out)
    with np.errstate(over="ignore"):
        padded: np.ndarray = np.nextafter(out * (1 + _REPEAT_PAD), np.inf)
    return np.where(out <= 0, np.maximum(out, 0.0), padded)


def training_unit(mechanism: AnyMechanism) -> np.ndarray | None:
    """Where a mechanism is a search (repeat-and-select) of a training run: that run's certified
    curve, the unit the job will train in after the search (filter.first_charge_spec); else None."""
    if isinstance(mechanism, RepeatAndSelect):
        return certified_curve(mechanism.event)
    return None


def trains(mechanism: AnyMechanism) -> bool:
    """Whether the mechanism holds a training step (a DP-SGD or Poisson-sampled leaf), as a job's
    training unit or a search of one does and a lone query (a Gaussian, an IFCA selection) does not."""
    return isinstance(mechanism, (DpSgd, PoissonSampled)) or any(trains(child) for child in children(mechanism))


def certified_curve(mechanism: AnyMechanism) -> np.ndarray:
    """The curve the ledger charges: rdp_curve with certified fractional orders."""
    return rdp_curve(mechanism, certified=True)


def _sampled_gaussian(q: float, sigma: float, *, certified: bool) -> np.ndarray:
    if certified:
        return np.array(_sampled_gaussian_cached(q, sigma))
    return _leaf_curve(PoissonSampled(sampling_rate=q, event=Gaussian(noise_multiplier=sigma)).model_dump_json())


@functools.lru_cache(maxsize=CACHE_SIZE)
def _sampled_gaussian_cached(q: float, sigma: float) -> tuple[float, ...]:
    if not 0 < q < 1:  # q = 1 is a Gaussian: dp-accounting's closed form
        step = PoissonSampled(sampling_rate=q, event=Gaussian(noise_multiplier=sigma))
        return tuple(_leaf_curve(step.model_dump_json()).tolist())
    # Our certified upper bound at every order, in a few numpy passes (sampled_gaussian.py), kept
    # wherever it is finite: soundness first. dp-accounting's float sums read below the exact
    # divergence at about half of the integer orders (~1e-8 relative at q ~ 1e-5), so its lower value
    # never replaces a certified one; the certificate is tight instead (within ~1e-9 of the exact
    # value over the workloads the ledger prices, tests/service/accounting/test_soundness.py). Only
    # where no certified value exists (an overflow) does the ledger take dp-accounting's, from
    # reference_curve.py (equal to its accountant's to the bit and 5–10× faster than its own loops).
    curve, _ = sampled_gaussian.curve_upper(q=q, sigma=sigma, orders=_ORDERS_ARRAY)
    missing = ~np.isfinite(curve)
    if missing.any():
        theirs = np.asarray(reference_curve.curve(q, sigma, ORDERS))
        curve = np.where(missing, theirs, curve)
    return tuple(np.maximum(curve, 0.0).tolist())


def times(count: int, curve: np.ndarray, *, up: bool = True) -> np.ndarray:
    """`count` runs of a mechanism of RDP `curve` (composition is addition), rounded up (`up`, the
    ledger's): a product rounded to nearest can sit half an ulp below count × curve, and a million
    steps read at the KL threshold of the conversion must never fall on its lower side."""
    if not up:
        scaled: np.ndarray = count * curve
        return scaled
    if count == 1:
        return curve.copy()
    with np.errstate(over="ignore"):
        product: np.ndarray = np.nextafter(count * curve, np.inf)
    return np.where(curve == 0, 0.0, product)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _leaf_curve_cached(mechanism_json: str) -> tuple[float, ...]:
    from pydantic import TypeAdapter

    from dpledger.wire.mechanisms import Mechanism

    mechanism = TypeAdapter(Mechanism).validate_json(mechanism_json)
    accountant = rdp_lib.RdpAccountant(list(ORDERS), neighboring_relation=_relation(mechanism))
    try:
        accountant.compose(to_dp_event(mechanism))
    except privacy_accountant.UnsupportedEventError as error:
        raise MechanismError("mechanism", f"dp-accounting's RDP accountant cannot account it: {error}") from error
    except (ValueError, ArithmeticError) as error:  # e.g. 1/b of a tiny Laplace scale, σ² that overflows or underflows
        raise MechanismError("mechanism", f"dp-accounting refused it: {error}") from error
    return tuple(accountant.rdp.tolist())


def _leaf_curve(mechanism_json: str) -> np.ndarray:
    return np.array(_leaf_curve_cached(mechanism_json))


def _relation(mechanism: AnyMechanism) -> privacy_accountant.NeighboringRelation:
    # dp-accounting analyses sampling without replacement only for replace-one neighbours, the
    # relation that fits a dataset of fixed, public size; everything else is add-or-remove-one. A
    # leaf that mixes both is refused by the accountant and so by us.
    if _contains_without_replacement(mechanism):
        return privacy_accountant.NeighboringRelation.REPLACE_ONE
    return privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE


def _contains_without_replacement(mechanism: AnyMechanism) -> bool:
    return isinstance(mechanism, SampledWithoutReplacement) or any(
        _contains_without_replacement(child) for child in children(mechanism)
    )


def rounded_up(total: np.ndarray, terms: int) -> np.ndarray:
    """A float sum of `terms` non-negative values moved up past its rounding (each addition is within
    half an ulp of its result, which never exceeds the final sum)."""
    if terms <= 1:
        return total
    with np.errstate(over="ignore"):
        raised: np.ndarray = np.nextafter(total * (1 + terms * 2.0**-53), np.inf)
    return np.where(total == 0, 0.0, raised)


def zero_curve() -> np.ndarray:
    return np.zeros(len(ORDERS))


def epsilon(curve: np.ndarray, *, delta: float) -> tuple[float, float]:
    """(ε, optimal order) at δ by dp-accounting's conversion (Canonne, Kamath, Steinke 2020)."""
    eps, order = rdp_lib.compute_epsilon(ORDERS, curve, delta)
    return float(eps), float(order)


@functools.lru_cache(maxsize=64)
def _conversion_terms(delta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per order: log1p(−1/α), log(δα)/(α − 1), and whether α > 1.01, with `math` as dp-accounting does."""
    usable = np.array([a > 1.01 for a in ORDERS])
    plus = np.array([math.log1p(-1 / a) if a > 1.01 else 0.0 for a in ORDERS])
    minus = np.array([math.log(delta * a) / (a - 1) if a > 1.01 else 0.0 for a in ORDERS])
    return plus, minus, usable


def epsilons(curves: np.ndarray, *, delta: float) -> np.ndarray:
    """ε at δ of each row of `curves` (one RDP curve per row), equal to `epsilon` row by row.

    dp-accounting's compute_epsilon converts one curve in a Python loop over the orders (~0.6 ms);
    a silo's history converts one curve per entry, so this is its conversion (Canonne, Kamath &
    Steinke 2020, Proposition 12) over a matrix, term for term as dp-accounting writes it."""
    curves = np.atleast_2d(np.asarray(curves, dtype=float))
    if delta <= 0:
        raise ValueError(f"delta must be positive. Found {delta}.")
    plus, minus, usable = _conversion_terms(delta)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = np.where(usable, (curves + plus) - minus, np.inf)
        # A negative divergence (numerical noise) or one below δ's KL bound: ε = 0, as dp-accounting says.
        bound = np.where((curves < 0) | (delta**2 + np.expm1(-curves) > 0), 0.0, bound)
    smallest: np.ndarray = np.maximum(0.0, bound.min(axis=1))
    return smallest


def rho(curve: np.ndarray) -> float | None:
    """zCDP ρ = sup_α ε(α)/α on the grid; None where the curve is infinite somewhere."""
    if not np.all(np.isfinite(curve)):
        return None
    return float(np.max(curve / _ORDERS_ARRAY))


def guarantee(curve: np.ndarray, *, delta: float) -> Guarantee:
    """The best-order ε the ledger states for a curve alone at the whole δ: dp-accounting's conversion
    read on its safe side (conversion.py), never below the exact conversion of the curve."""
    eps = conversion.order_epsilons(_ORDERS_ARRAY, np.asarray(curve, dtype=float), np.full(len(ORDERS), delta))
    best = int(np.argmin(eps))
    return Guarantee(epsilon=float(eps[best]), order=ORDERS[best], rho=rho(curve))


def within_budget(eps: float, *, budget: float) -> bool:
    # No tolerance: the budget is the silo's promise. Calibration leaves the margin instead
    # (reports.calibrate_dpsgd_noise), so that a plan calibrated to the budget still fits.
    return math.isfinite(eps) and eps <= budget
