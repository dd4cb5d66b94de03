"""Reports beside the RDP ledger: the tighter PLD ε for audits, and noise calibration."""

from __future__ import annotations

from dataclasses import dataclass

from dp_accounting import dp_event as de
from dp_accounting import mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpledger.service.accounting.events import MechanismError, to_dp_event
from dpledger.service.accounting.rdp import ORDERS
from dpledger.wire.mechanisms import AnyMechanism

# 1e-3 keeps a 10^4-step DP-SGD report well under a second; the PLD accountant's discretisation is
# pessimistic, so a coarser grid only makes the reported ε larger, never smaller.
PLD_DISCRETIZATION = 1e-3


@dataclass(frozen=True)
class PldReport:
    epsilon: float | None
    unsupported_reason: str | None


def pld_epsilon(mechanism: AnyMechanism, *, delta: float, skip_reason: str | None = None) -> PldReport:
    """ε from dp-accounting's PLD accountant, or why it cannot (or, per `cost.check`'s
    `skip_reason`, may not) report one for this mechanism."""
    if skip_reason is not None:
        return PldReport(None, skip_reason)
    event = to_dp_event(mechanism)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    if not accountant.supports(event):
        return PldReport(None, f"dp-accounting's PLD accountant does not support {type(event).__name__} in this mechanism")
    try:
        accountant.compose(event)
        return PldReport(float(accountant.get_epsilon(delta)), None)
    except (ValueError, ArithmeticError, MemoryError) as error:  # a report beside the ledger: never a 500
        return PldReport(None, f"dp-accounting's PLD accountant failed on this mechanism: {type(error).__name__}")


def dpsgd_event(*, noise_multiplier: float, sampling_rate: float, steps: int) -> de.DpEvent:
    return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(sampling_rate, de.GaussianDpEvent(noise_multiplier)), steps)


def dpsgd_epsilon(*, noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    accountant.compose(dpsgd_event(noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps))
    return float(accountant.get_epsilon(delta))


# The ledger's gate has no tolerance, and a charge's ε is computed through a different path (a
# cached per-step curve times the steps, added to the silo's running sum) than this calibration's:
# aiming a hair below the target leaves room for that rounding, so a plan calibrated to the budget fits.
CALIBRATION_MARGIN = 1e-9


def calibrate_dpsgd_noise(*, epsilon: float, delta: float, sampling_rate: float, steps: int) -> tuple[float, float]:
    """The smallest σ (within 1e-6 relative) whose DP-SGD ε at δ stays below `epsilon` by the
    margin above.

    dp-accounting brackets the root; we then step σ up until the ε it gives is within the target,
    so rounding in the search can only cost noise, never privacy (STYLE.md, Opacus).
    """
    epsilon = epsilon * (1 - CALIBRATION_MARGIN)

    def make_event(sigma: float) -> de.DpEvent:
        return dpsgd_event(noise_multiplier=sigma, sampling_rate=sampling_rate, steps=steps)

    try:
        sigma = float(
            mechanism_calibration.calibrate_dp_mechanism(
                lambda: rdp_privacy_accountant.RdpAccountant(list(ORDERS)),
                make_event,
                epsilon,
                delta,
                mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0),
                tol=1e-7,
            )
        )
    except (mechanism_calibration.NoBracketIntervalFoundError, ArithmeticError) as error:
        # A target so small that no σ dp-accounting can represent reaches it: the request's fault.
        raise MechanismError(
            "epsilon", f"no noise multiplier reaches ε={epsilon!r} at δ={delta!r} with sampling_rate={sampling_rate!r} "
            f"and steps={steps}: {error}"
        ) from error
    eps = dpsgd_epsilon(noise_multiplier=sigma, sampling_rate=sampling_rate, steps=steps, delta=delta)
    while eps > epsilon:
        sigma *= 1 + 1e-6
        eps = dpsgd_epsilon(noise_multiplier=sigma, sampling_rate=sampling_rate, steps=steps, delta=delta)
    return sigma, eps
