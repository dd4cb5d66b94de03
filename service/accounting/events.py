"""Wire mechanisms as `dp_accounting` events, and the silo context they are resolved in."""

from __future__ import annotations

import math

from dp_accounting import dp_event as de

from dpledger.wire.mechanisms import (
    AnyMechanism,
    Composed,
    DpSgd,
    Gaussian,
    Laplace,
    PoissonSampled,
    RepeatAndSelect,
    SampledWithoutReplacement,
    SelfComposed,
    ZCdp,
)


class MechanismError(ValueError):
    """A mechanism that is well-formed but does not fit its context; `field` is a dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def resolve(mechanism: AnyMechanism, *, dataset_size: int | None, path: str = "mechanism") -> AnyMechanism:
    """Fill in each dpsgd's sampling rate from the silo's registered dataset size.

    A declared sampling_rate that disagrees with batch_size / dataset_size is refused, and so is a
    batch_size with no dataset size to divide by.
    """
    if isinstance(mechanism, DpSgd):
        if mechanism.batch_size is None:
            return mechanism
        if dataset_size is None:
            raise MechanismError(f"{path}.batch_size", "needs a silo's dataset_size; give sampling_rate or silo_id")
        if mechanism.batch_size > dataset_size:
            raise MechanismError(
                f"{path}.batch_size", f"must be at most the silo's dataset_size={dataset_size}. Found {mechanism.batch_size}."
            )
        rate = mechanism.batch_size / dataset_size
        if mechanism.sampling_rate is not None and not math.isclose(mechanism.sampling_rate, rate, rel_tol=1e-9):
            raise MechanismError(
                f"{path}.sampling_rate",
                f"must equal batch_size / dataset_size = {mechanism.batch_size}/{dataset_size} = {rate!r}. "
                f"Found {mechanism.sampling_rate!r}.",
            )
        return mechanism.model_copy(update={"sampling_rate": rate})
    if isinstance(mechanism, Composed):
        events = [resolve(e, dataset_size=dataset_size, path=f"{path}.events.{i}") for i, e in enumerate(mechanism.events)]
        return mechanism.model_copy(update={"events": events})
    inner = getattr(mechanism, "event", None)
    if inner is None:
        return mechanism
    return mechanism.model_copy(update={"event": resolve(inner, dataset_size=dataset_size, path=f"{path}.event")})


def to_dp_event(mechanism: AnyMechanism) -> de.DpEvent:
    """The `dp_accounting` event this mechanism means (one to one). dpsgd must be resolved first."""
    match mechanism:
        case Gaussian(noise_multiplier=sigma):
            return de.GaussianDpEvent(sigma)
        case Laplace(noise_multiplier=b):
            return de.LaplaceDpEvent(b)
        case PoissonSampled(sampling_rate=q, event=inner):
            return de.PoissonSampledDpEvent(q, to_dp_event(inner))
        case SampledWithoutReplacement(source_size=n, sample_size=m, event=inner):
            return de.SampledWithoutReplacementDpEvent(n, m, to_dp_event(inner))
        case SelfComposed(count=count, event=inner):
            return de.SelfComposedDpEvent(to_dp_event(inner), count)
        case Composed(events=events):
            return de.ComposedDpEvent([to_dp_event(e) for e in events])
        case ZCdp(rho=rho, xi=xi):
            return de.ZCDpEvent(rho, xi)
        case RepeatAndSelect(event=inner, mean=mean):
            return de.RepeatAndSelectDpEvent(to_dp_event(inner), mean, mechanism.shape_value)
        case DpSgd(sampling_rate=q, noise_multiplier=sigma, steps=steps):
            if q is None:
                raise MechanismError("mechanism.sampling_rate", "unresolved dpsgd: batch_size needs a dataset_size")
            return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)
    raise TypeError(f"unknown mechanism {type(mechanism).__name__}")
