"""Mechanisms on the wire: a pydantic tagged union that maps one to one onto `dp_accounting` events
(the mapping itself is the service's: `dpledger.service.accounting.events`).

A stored mechanism must read the same in five years (as dp-accounting does): a kind is never
edited, only added. Every number is validated here, so a bad one is a 422 naming the field and
nothing downstream ever sees NaN, infinity or an absurd count.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_NESTING = 8
MAX_COUNT = 10_000_000  # steps / self-composition count: ~a decade of one step per 30 s
MAX_COMPOSED = 1_000
MAX_DATASET = 10**12

# Finite by construction: NaN and ±inf are refused by pydantic before any bound is checked. Strict:
# a JSON `true` is no number (lax pydantic would read it as 1, a sampling rate of q = 1).
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
Probability = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT, strict=True)]
Size = Annotated[int, Field(ge=1, le=MAX_DATASET, strict=True)]


class _Mechanism(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gaussian(_Mechanism):
    type: Literal["gaussian"] = "gaussian"
    noise_multiplier: PositiveFloat


class Laplace(_Mechanism):
    type: Literal["laplace"] = "laplace"
    noise_multiplier: PositiveFloat


class PoissonSampled(_Mechanism):
    """Each record joins independently with probability q. Charged to a silo, the wire says
    `expected_batch_size` (the expected number of records sampled, B) and the service derives
    q = B / the silo's registered dataset_size; a raw `sampling_rate` is taken only by quotes and
    calibration, which charge nobody. A stored (resolved) charge holds both."""

    type: Literal["poisson_sampled"] = "poisson_sampled"
    sampling_rate: Probability | None = None
    expected_batch_size: Size | None = None
    event: Mechanism

    @model_validator(mode="after")
    def _rate_or_batch(self) -> PoissonSampled:
        if self.sampling_rate is None and self.expected_batch_size is None:
            raise ValueError("poisson_sampled needs expected_batch_size (or, in a quote, sampling_rate)")
        return self


class SampledWithoutReplacement(_Mechanism):
    type: Literal["sampled_without_replacement"] = "sampled_without_replacement"
    source_size: Size
    sample_size: Size
    event: Mechanism

    @model_validator(mode="after")
    def _sample_fits(self) -> SampledWithoutReplacement:
        if self.sample_size > self.source_size:
            raise ValueError(
                f"sample_size must be at most source_size={self.source_size}. Found {self.sample_size}."
            )
        return self


class SelfComposed(_Mechanism):
    type: Literal["self_composed"] = "self_composed"
    count: Count
    event: Mechanism


class Composed(_Mechanism):
    type: Literal["composed"] = "composed"
    events: Annotated[list[Mechanism], Field(min_length=1, max_length=MAX_COMPOSED)]


class ZCdp(_Mechanism):
    type: Literal["zcdp"] = "zcdp"
    rho: PositiveFloat
    xi: NonNegativeFloat = 0.0


class RepeatAndSelect(_Mechanism):
    """Papernot & Steinke 2022: a random number of runs K, the best one released.

    shape 0 = logarithmic, 1 = geometric, 0<η<∞ truncated negative binomial, "infinity" = Poisson.
    """

    type: Literal["repeat_and_select"] = "repeat_and_select"
    event: Mechanism
    mean: Annotated[float, Field(ge=1, le=MAX_COUNT, allow_inf_nan=False, strict=True)]
    shape: Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)] | Literal["infinity"]

    @property
    def shape_value(self) -> float:
        return math.inf if self.shape == "infinity" else float(self.shape)


class DpSgd(_Mechanism):
    """`steps` × Poisson-sampled Gaussian. Charged to a silo it must give `batch_size` (the expected
    Poisson batch): the service derives q = batch_size / the silo's registered dataset_size and never
    trusts a loader's idea of q; a raw `sampling_rate` is taken only by quotes and calibration."""

    type: Literal["dpsgd"] = "dpsgd"
    noise_multiplier: PositiveFloat
    steps: Count
    sampling_rate: Probability | None = None
    batch_size: Size | None = None

    @model_validator(mode="after")
    def _rate_or_batch(self) -> DpSgd:
        if self.sampling_rate is None and self.batch_size is None:
            raise ValueError("dpsgd needs sampling_rate or batch_size")
        return self


# The nine kinds, once: the plain union for code that walks a tree, and the tagged one pydantic parses.
AnyMechanism: TypeAlias = (
    Gaussian | Laplace | PoissonSampled | SampledWithoutReplacement | SelfComposed | Composed | ZCdp | RepeatAndSelect | DpSgd
)
Mechanism = Annotated[AnyMechanism, Field(discriminator="type")]

for _model in (PoissonSampled, SampledWithoutReplacement, SelfComposed, Composed, RepeatAndSelect):
    _model.model_rebuild()


def children(mechanism: AnyMechanism) -> list[AnyMechanism]:
    if isinstance(mechanism, Composed):
        return list(mechanism.events)
    inner = getattr(mechanism, "event", None)
    return [inner] if inner is not None else []


def nesting_depth(mechanism: AnyMechanism) -> int:
    return 1 + max((nesting_depth(c) for c in children(mechanism)), default=0)


def check_nesting(value: Any) -> Any:
    """Refuse deep nesting on the raw JSON, before pydantic recurses into it."""
    depth = _raw_depth(value)
    if depth > MAX_NESTING:
        raise ValueError(f"nesting must be at most {MAX_NESTING} levels deep. Found {depth}.")
    return value


def _raw_depth(value: Any, level: int = 0) -> int:
    if level > MAX_NESTING + 1:
        return level  # deep enough to refuse; stop before Python's recursion limit
    if isinstance(value, dict):
        nested = [v for k, v in value.items() if k in ("event", "events")]
        if not nested:
            return 1
        return 1 + max(_raw_depth(v, level + 1) for v in nested)
    if isinstance(value, list):
        return max((_raw_depth(v, level) for v in value), default=0)
    return 0
