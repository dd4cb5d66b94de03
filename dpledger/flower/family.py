"""The algorithm family over Flower: the registry's halves, built from a run's public settings, and
their tensors as Flower records.

Both apps build an algorithm's halves from the same public values: its name, its options (flat
keys of the run config named after them, `lam`, `personal-steps`, `selection-noise-multiplier`…,
which the server copies into every train message) and the DP-SGD hyperparameters of the run. The
server half runs in the ServerApp's strategy, the silo half in each ClientApp over its own silo. A
silo's σ and data come from its own node config, never from these values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from dpledger.flower.local import SiloData, template
from dpledger.trainer.federated import registry
from dpledger.trainer.federated.base import FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.federated.engine import SiloEngine, fresh_streams
from dpledger.trainer.federated.halves import Arrays, Halves
from dpledger.trainer.federated.models import FlatModel
from dpledger.trainer.federated.padded import PaddedSilos
from dpledger.trainer.federated.plan import Mechanism, RoundPlan

CPU = torch.device("cpu")


class FamilyError(ValueError):
    """An algorithm's name, options or hyperparameters are invalid; the message names which."""


def algorithm_class(name: object) -> type[FederatedAlgorithm]:
    known = registry.algorithms()
    if not isinstance(name, str) or name not in known:
        raise FamilyError(f"'algorithm' must be one of {', '.join(known)}. Found {name!r}.")
    return known[name]


def _dataclass_of(annotation: object) -> type[Any] | None:
    """The dataclass an option's annotation names (`ClusterSelection`, `AdaptiveClip | None`), if any."""
    candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return next((c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def config_key(option: str) -> str:
    """An option's key in the run config and the train messages: `personal_steps` → `personal-steps`."""
    return option.replace("_", "-")


def option_keys(cls: type[FederatedAlgorithm]) -> list[str]:
    """Every config key the algorithm reads its options from (a dataclass option's fields prefixed
    with its name: `selection-noise-multiplier`)."""
    hints = typing.get_type_hints(cls.halves)
    keys = []
    for option in registry.options(cls):
        nested = _dataclass_of(hints.get(option))
        if nested is None:
            keys.append(config_key(option))
        else:
            keys.extend(f"{config_key(option)}-{config_key(f.name)}" for f in dataclasses.fields(nested))
    return keys


def options_from(cls: type[FederatedAlgorithm], config: Mapping[str, object]) -> dict[str, Any]:
    """The algorithm's options from the flat keys of a run config or train message (`lam`,
    `personal-steps`, `selection-noise-multiplier`, …); an absent key, or "" (the app's declared
    "unset": Flower takes overrides only of declared keys), leaves the option's default."""
    hints = typing.get_type_hints(cls.halves)
    out: dict[str, Any] = {}
    for option in registry.options(cls):
        nested = _dataclass_of(hints.get(option))
        if nested is None:
            if config.get(config_key(option), "") != "":
                out[option] = config[config_key(option)]
            continue
        fields = {f.name: config[key] for f in dataclasses.fields(nested)
                  if config.get(key := f"{config_key(option)}-{config_key(f.name)}", "") != ""}
        if fields:
            try:
                out[option] = nested(**fields)
            except (TypeError, ValueError) as error:
                raise FamilyError(f"{config_key(option)}: {error}") from None
    return out


def dpsgd_config(config: Mapping[str, object], *, noise_multiplier: float = 1.0) -> DPSGDConfig:
    """The run's DP-SGD hyperparameters from a train message's (or the run's) config; σ is the silo's own."""
    def number(key: str) -> float:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise FamilyError(f"{key!r} must be a finite number. Found {value!r}.")
        return float(value)

    def integer(key: str, minimum: int) -> int:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise FamilyError(f"{key!r} must be an integer >= {minimum}. Found {value!r}.")
        return value

    try:
        return DPSGDConfig(lr=number("lr"), clip_norm=number("clip-norm"), noise_multiplier=noise_multiplier,
                           batch_size=integer("batch-size", 1), local_steps=integer("local-steps", 1),
                           seed=integer("seed", 0))
    except ValueError as error:
        raise FamilyError(str(error)) from None


def halves(config: Mapping[str, object], *, noise_multiplier: float = 1.0) -> Halves:
    """The halves of the algorithm a config names, with its options (a FamilyError names what is wrong)."""
    cls = algorithm_class(config.get("algorithm"))
    options = options_from(cls, config)
    try:
        return cls.halves(dpsgd_config(config, noise_multiplier=noise_multiplier), **options)
    except TypeError as error:  # a required option is missing: name its key, not the Python argument
        missing = [config_key(o) for o, p in registry.options(cls).items() if p.default is p.empty and o not in options]
        raise FamilyError(f"{cls.name} needs {', '.join(missing)}." if missing else f"{cls.name}: {error}") from None
    except ValueError as error:
        raise FamilyError(f"{cls.name}: {error}") from None


def public_options(config: Mapping[str, object]) -> dict[str, object]:
    """The keys of `config` that the algorithm it names reads its options from, to copy into train messages."""
    keys = option_keys(algorithm_class(config.get("algorithm")))
    return {key: config[key] for key in keys if config.get(key, "") != ""}


def one_silo_engine(model: FlatModel, x: torch.Tensor, y: torch.Tensor, config: DPSGDConfig) -> SiloEngine:
    """A silo's own engine over its own records, its batches and noise drawn from OS randomness, each
    step the silo library's own (the engine `bench/dpsgd_throughput.py` times against Opacus)."""
    train = PaddedSilos.from_tensors([x], [y], task="classification", device=CPU, allow_empty=False)
    return SiloEngine(train=train, model=model, config=config, noise_multipliers=[config.noise_multiplier],
                      streams=fresh_streams(CPU), device=CPU, one_step_per_silo=True)


def to_record(arrays: Arrays) -> ArrayRecord:
    """Named tensors as a Flower ArrayRecord (float32 parameters, integer and boolean state as they are)."""
    out: dict[str, Array] = {}
    for key, tensor in arrays.items():
        value = tensor.detach().cpu().numpy()
        out[key] = Array(value.astype(np.float32) if value.dtype.kind == "f" else value)
    return ArrayRecord(out)


def from_record(record: ArrayRecord) -> Arrays:
    return {key: torch.as_tensor(np.array(record[key].numpy())) for key in record}


def stack(uploads: list[Arrays]) -> Arrays:
    """Per-silo uploads ([1, ...] each) as one upload over those silos ([A, ...]), in the same order."""
    if not uploads:
        return {}
    keys = set(uploads[0])
    if any(set(u) != keys for u in uploads):
        raise FamilyError(f"the silos' uploads hold different arrays: {[sorted(u) for u in uploads]}")
    return {key: torch.cat([u[key] for u in uploads]) for key in sorted(keys)}


@dataclass(frozen=True)
class SiloRound:
    """One silo's round of the algorithm a train message names: its silo half over this silo's own
    engine, and what the round will query of its data (what the gate asks the ledger to approve)."""

    round_index: int
    halves: Halves
    engine: SiloEngine
    model: FlatModel

    def plan(self) -> RoundPlan:
        return RoundPlan(round_index=self.round_index, queries=(self.halves.silo.queries(self.round_index, self.engine, 0),))

    def mechanism(self) -> Mechanism:
        mechanism = self.plan().mechanisms()[0]
        assert mechanism is not None  # a silo half asked to train always queries its data
        return mechanism

    def mechanism_json(self) -> str:
        """The mechanism as the gate records its approval, so the ClientApp can check it is the one it runs."""
        return json.dumps(self.mechanism().model_dump(mode="json", exclude_none=True), sort_keys=True)


@dataclass(frozen=True)
class SiloParts:
    """What a silo builds for a run's algorithm, whatever the round: its silo half, the run's model,
    and its own engine over its own records."""

    halves: Halves
    model: FlatModel
    engine: SiloEngine

    def round(self, config: Mapping[str, object]) -> SiloRound:
        """The round a train message's config asks of this silo."""
        round_index = config.get("round")
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise FamilyError(f"'round' must be an integer >= 0. Found {round_index!r}.")
        return SiloRound(round_index, self.halves, self.engine, self.model)


def silo_parts(config: Mapping[str, object], data: SiloData, *, noise_multiplier: float) -> SiloParts:
    """The halves, model and engine of the algorithm a config names, over this silo's data and its own σ."""
    built = halves(config, noise_multiplier=noise_multiplier)
    model = template(seed=built.silo.config.seed)
    return SiloParts(built, model, one_silo_engine(model, data.x, data.y, built.silo.config))

