"""Reports beside the RDP ledger: the tighter PLD ε for audits, and noise calibration."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event as de
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize

from dpledger.service.accounting import cost, rdp
from dpledger.service.accounting.events import MechanismError, to_dp_event
from dpledger.service.accounting.rdp import ORDERS
from dpledger.wire.mechanisms import AnyMechanism, DpSgd

# 1e-3 keeps a 10^4-step DP-SGD report well under a second; the PLD accountant's discretisation is
# pessimistic, so a coarser grid only makes the reported ε larger, never smaller.
PLD_DISCRETIZATION = 1e-3


@dataclass(frozen=True)
class PldReport:
    epsilon: float | None
    unsupported_reason: str | None


def pld_epsilon(mechanism: AnyMechanism, *, delta: float, skip_reason: str | None = None) -> PldReport:
    """ε from dp-accounting's PLD accountant, or why it cannot (or, per `cost.check`'s
    `skip_reason`, may not) report one for this mechanism. Run under a guard of its own priced at its
    estimate: a report that outruns it is stopped and skipped, the request goes on."""
    if skip_reason is not None:
        return PldReport(None, skip_reason)
    event = to_dp_event(mechanism)
    accountant = MeteredPLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    if not accountant.supports(event):
        return PldReport(None, f"dp-accounting's PLD accountant does not support {type(event).__name__} in this mechanism")
    price = cost.estimate(mechanism).pld_seconds(PLD_DISCRETIZATION)
    try:
        with cost.guard("mechanism", price=price, slack=cost.PART_SLACK):
            accountant.compose(event)
            return PldReport(float(accountant.get_epsilon(delta)), None)
    except cost.Stopped as stopped:
        return PldReport(None, f"PLD report stopped after {stopped.spent:.2f} s of CPU, past its price ({price:.2g} s)")
    except (ValueError, ArithmeticError, MemoryError) as error:  # a report beside the ledger: never a 500
        return PldReport(None, f"dp-accounting's PLD accountant failed on this mechanism: {type(error).__name__}")


class MeteredPLDAccountant(pld_privacy_accountant.PLDAccountant):  # type: ignore[misc]  # dp-accounting is untyped
    """dp-accounting's PLD accountant with the request's guard ticked before each PLD it builds and
    composes (cost.tick): its work is one PLD per node of the event, each up to seconds."""

    def _maybe_compose(self, event: de.DpEvent, count: int, do_compose: bool) -> object:
        if do_compose and not isinstance(event, de.ComposedDpEvent | de.SelfComposedDpEvent):
            cost.tick()
        return super()._maybe_compose(event, count, do_compose)


def dpsgd_event(*, noise_multiplier: float, sampling_rate: float, steps: int) -> de.DpEvent:
    return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(sampling_rate, de.GaussianDpEvent(noise_multiplier)), steps)


def dpsgd_epsilon(*, noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    """dp-accounting's ε of a DP-SGD run: the reference the ledger's own calibration is checked against."""
    accountant = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    accountant.compose(dpsgd_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps))
    return float(accountant.get_epsilon(delta))


# The ledger's gate has no tolerance, and a charge's ε is computed through a different path (a
# cached per-step curve times the steps, added to the silo's running sum) than this calibration's:
# aiming a hair below the target leaves room for that rounding, so a plan calibrated to the budget fits.
CALIBRATION_MARGIN = 1e-9


# A σ search is priced as it runs: each of its steps computes a new (q, σ) pair's certified curve
# (~5 ms), and how many steps it takes depends on where the root lies; so it runs under a
# CPU guard of its own (cost.guard), ticked step by step, and is refused (a 422) past the bound every
# request has, after its σ range was bounded before it started.
# As before issue 46 (legitimate searches near q = 1 take ~1.5 s on a busy box); the step that crosses
# it still runs (one (q, σ) pair near q = 1: up to ~0.4 s).
MAX_CALIBRATION_SECONDS = cost.GUARD_SECONDS


def _search_guard(field: str) -> AbstractContextManager[cost.Guard]:
    return cost.guard(field, seconds=MAX_CALIBRATION_SECONDS, message=(
        f"the σ search was stopped after {MAX_CALIBRATION_SECONDS:g} s of CPU, the most one request may cost (each of "
        "its steps composes a new (q, σ) pair): ask for fewer steps, a smaller sampling rate or a larger ε"))


def calibrate_dpsgd_noise(*, epsilon: float, delta: float, sampling_rate: float, steps: int) -> tuple[float, float]:
    """The smallest σ (within 1e-9 relative, rounded up) whose DP-SGD ε at δ, as the ledger states
    it (its certified curve read by `rdp.guarantee`), stays below `epsilon` by the margin above, and
    that ε. The search runs on the ledger's own curves: a quote of that σ reads what it returned,
    rounding costs noise, never privacy, and a step costs ~5 ms where dp-accounting's calibration
    composes a new (q, σ) pair at 30–100 ms each (a 2-silo demo's calibration neared the 2 s bound)."""
    found = calibrate_remaining(
        rdp.zero_curve(), budget=epsilon, sampling_rate=sampling_rate, steps=steps, field="epsilon",
        epsilon_of=lambda curve: rdp.guarantee(curve, delta=delta).epsilon,
    )
    return found.noise_multiplier, found.epsilon_after


# Brackets of the remaining-budget search: below 1e-3 dp-accounting's Poisson-Gaussian series is
# meaningless for any budget a ledger accepts, and above 1e4 the noise drowns any gradient.
SIGMA_FLOOR = 1e-3
SIGMA_CEILING = 1e4
# ε of many DP-SGD steps falls steeply in σ (d ln ε / d ln σ ≈ −12 at 300 steps, q = 0.01, σ ≈ 0.93
# under a filter), so σ is found to 1e-9 relative for ε to land within ~1e-8 of the budget.
SIGMA_RELATIVE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class RemainingCalibration:
    noise_multiplier: float
    epsilon_after: float


def calibrate_remaining(
    spent: np.ndarray, *, budget: float, sampling_rate: float, steps: int, epsilon_of: Callable[[np.ndarray], float],
    field: str = "rounds",
) -> RemainingCalibration:
    """The smallest σ (within 1e-9 relative, rounded up) such that `steps` more DP-SGD steps at
    `sampling_rate`, added to the RDP curve already spent, keep ε at δ within `budget`.

    dp-accounting's `calibrate_dp_mechanism` composes from an empty accountant, and Opacus'
    `get_noise_multiplier` likewise assumes nothing was spent; a ledger calibrates what is LEFT, so
    this searches σ over the running sum plus the planned steps (a bracket, then Brent's method),
    and returns a σ whose ε it has checked to fit: rounding costs noise, never privacy.

    `epsilon_of` converts a running sum to ε the way the silo's gate does (ledger/gate.py), and the
    planned steps are charged as the ledger charges them (rdp.certified_curve).
    """
    if not math.isfinite(budget) or budget <= 0:
        raise MechanismError("epsilon", f"must be finite and > 0. Found {budget!r}.")
    budget = budget * (1 - CALIBRATION_MARGIN)  # the ledger's gate has no tolerance

    def epsilon_after(sigma: float) -> float:
        cost.tick()
        planned = DpSgd(sampling_rate=sampling_rate, noise_multiplier=sigma, steps=steps)
        return epsilon_of(spent + rdp.certified_curve(planned))

    with _search_guard(field):
        return _search_remaining(epsilon_after, epsilon_of(spent), budget=budget, field=field)


def _search_remaining(
    epsilon_after: Callable[[float], float], already: float, *, budget: float, field: str,
) -> RemainingCalibration:

    if not already < budget:
        raise MechanismError(field, f"nothing is left to plan with: the silo has spent ε={already:.6g} of {budget:.6g}")
    high = 1.0
    while (eps_high := epsilon_after(high)) > budget:
        if high >= SIGMA_CEILING:
            raise MechanismError(
                field, f"even σ={SIGMA_CEILING:g} gives ε={eps_high:.6g} > what is left of ε={budget:.6g} (spent "
                f"{already:.6g}): ask for fewer rounds or steps, a smaller sampling rate or a larger ε"
            )
        high = min(high * 4.0, SIGMA_CEILING)
    low = high / 4.0
    while low > SIGMA_FLOOR and epsilon_after(low) <= budget:
        high, low = low, low / 4.0
    if low > SIGMA_FLOOR:
        # ε(σ) is continuous and non-increasing: Brent's method finds the crossing in ~10 curves
        # where plain bisection needs ~25 (each a new pair's certified curve and its conversion).
        # An infinite ε (the spent curve may hold orders at ∞) is capped so the secant steps stay finite.
        try:
            sigma = float(optimize.brentq(lambda s: min(epsilon_after(s), 1e300) - budget, low, high,
                                          rtol=SIGMA_RELATIVE_TOLERANCE))
        except (ValueError, RuntimeError):
            sigma = high  # no crossing found: keep the feasible end of the bracket
        while sigma < high and epsilon_after(sigma) > budget:
            sigma *= 1 + SIGMA_RELATIVE_TOLERANCE  # round up until it fits: costs noise, never privacy
        high = min(sigma, high)
    return RemainingCalibration(noise_multiplier=high, epsilon_after=epsilon_after(high))
