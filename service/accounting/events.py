"""Wire mechanisms as `dp_accounting` events, and the silo context they are resolved in."""

from __future__ import annotations

import math

from dp_accounting import dp_event as de

from dpledger.wire.enums import Relation
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
    children,
)


class MechanismError(ValueError):
    """A mechanism that is well-formed but does not fit its context; `field` is a dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def resolve(
    mechanism: AnyMechanism, *, dataset_size: int | None, charged: bool = False, path: str = "mechanism"
) -> AnyMechanism:
    """Fill in every sampling rate from the silo's registered dataset size.

    `charged` (a silo's charge or search): q is the service's, always. dpsgd must give batch_size
    and poisson_sampled expected_batch_size; a raw sampling_rate anywhere is refused, and
    sampled_without_replacement's source_size must be the registered size. Otherwise (quotes,
    which charge nobody) a raw rate is taken as given, and batch sizes still need a dataset size.
    """
    if isinstance(mechanism, DpSgd):
        rate = _declared_size_rate(
            mechanism.sampling_rate, mechanism.batch_size, "batch_size", "the expected Poisson batch",
            dataset_size=dataset_size, charged=charged, path=path,
        )
        return mechanism if rate is None else mechanism.model_copy(update={"sampling_rate": rate})
    if isinstance(mechanism, PoissonSampled):
        rate = _declared_size_rate(
            mechanism.sampling_rate, mechanism.expected_batch_size, "expected_batch_size",
            "the expected number of records sampled", dataset_size=dataset_size, charged=charged, path=path,
        )
        event = resolve(mechanism.event, dataset_size=dataset_size, charged=charged, path=f"{path}.event")
        update: dict[str, object] = {"event": event} if rate is None else {"sampling_rate": rate, "event": event}
        return mechanism.model_copy(update=update)
    if isinstance(mechanism, SampledWithoutReplacement) and charged and mechanism.source_size != dataset_size:
        raise MechanismError(
            f"{path}.source_size",
            f"must be the silo's registered dataset_size={dataset_size} on a silo's charge. Found {mechanism.source_size}.",
        )
    if isinstance(mechanism, Composed):
        events = [
            resolve(e, dataset_size=dataset_size, charged=charged, path=f"{path}.events.{i}")
            for i, e in enumerate(mechanism.events)
        ]
        return mechanism.model_copy(update={"events": events})
    inner = getattr(mechanism, "event", None)
    if inner is None:
        return mechanism
    event = resolve(inner, dataset_size=dataset_size, charged=charged, path=f"{path}.event")
    return mechanism.model_copy(update={"event": event})


def _declared_size_rate(
    declared: float | None, size: int | None, size_field: str, meaning: str, *,
    dataset_size: int | None, charged: bool, path: str,
) -> float | None:
    """q from a declared size over the registered dataset size (None: no size given, keep the rate).

    A silo's charge may not declare q itself; elsewhere a declared q must agree with the size's."""
    if charged and declared is not None:
        raise MechanismError(
            f"{path}.sampling_rate",
            f"is not taken on a silo's charge: send {size_field} ({meaning}) and the service "
            f"computes q = {size_field} / the silo's registered dataset_size",
        )
    if size is None:
        return None
    rate = _rate(size, dataset_size, field=f"{path}.{size_field}")
    if declared is not None and not math.isclose(declared, rate, rel_tol=1e-9):
        raise MechanismError(
            f"{path}.sampling_rate",
            f"must equal {size_field} / dataset_size = {size}/{dataset_size} = {rate!r}. Found {declared!r}.",
        )
    return rate


def _rate(batch: int, dataset_size: int | None, *, field: str) -> float:
    if dataset_size is None:
        raise MechanismError(field, "needs a silo's dataset_size; give silo_id (or, in a quote, sampling_rate)")
    if batch > dataset_size:
        raise MechanismError(field, f"must be at most the silo's dataset_size={dataset_size}. Found {batch}.")
    return batch / dataset_size


# The relation each kind is analysed under by dp-accounting; kinds absent here fit either.
_RELATION_OF = {
    DpSgd: Relation.add_remove,
    PoissonSampled: Relation.add_remove,
    SampledWithoutReplacement: Relation.replace_one,
}


def relations(mechanism: AnyMechanism) -> set[Relation]:
    """The neighbouring relations the mechanism's parts are analysed under (empty: fits either)."""
    own = _RELATION_OF.get(type(mechanism))
    found = {own} if own is not None else set()
    for child in children(mechanism):
        found |= relations(child)
    return found


def check_relation(mechanism: AnyMechanism, *, silo_relation: Relation | None, path: str = "mechanism") -> Relation:
    """The one relation the whole mechanism is accounted under. A mechanism mixing relations is
    refused (dp-accounting's accountants refuse such an event too: curves of different relations do
    not add), and so is one of the other relation than the silo's."""
    found = relations(mechanism)
    if len(found) > 1:
        raise MechanismError(
            path,
            "mixes neighbouring relations: sampled_without_replacement is analysed under replace-one, dpsgd and "
            "poisson_sampled under add/remove-one, and their privacy curves do not compose (dp-accounting refuses such an "
            "event too); charge them separately on silos of the matching relation",
        )
    if silo_relation is not None and found and found != {silo_relation}:
        (other,) = found
        raise MechanismError(
            path,
            f"is analysed under the {other.value} relation, but this silo is registered with relation="
            f"{silo_relation.value}; a silo's charges must all use its one relation",
        )
    return next(iter(found), silo_relation or Relation.add_remove)


def to_dp_event(mechanism: AnyMechanism) -> de.DpEvent:
    """The `dp_accounting` event this mechanism means (one to one). dpsgd must be resolved first."""
    match mechanism:
        case Gaussian(noise_multiplier=sigma):
            return de.GaussianDpEvent(sigma)
        case Laplace(noise_multiplier=b):
            return de.LaplaceDpEvent(b)
        case PoissonSampled(sampling_rate=q, event=inner):
            if q is None:
                raise MechanismError("mechanism.expected_batch_size", "needs a silo's dataset_size; give silo_id")
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
