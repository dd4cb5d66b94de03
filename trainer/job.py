"""`dpledger train`: a configured job against any ledger, from a TOML file or flags.

Each silo is named by its ledger id and its own key (given inline or, better, by the name of an
environment variable holding it), in the order of the data's silos.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dpledger.trainer.client import LedgerClient
from dpledger.trainer.data import FederatedDataset
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.data.npz import load_npz_folder
from dpledger.trainer.federated import (
    AlgorithmArgs,
    ClusterSelection,
    DPSGDConfig,
    FederatedAlgorithm,
    clustering_rounds,
    registry,
)
from dpledger.trainer.loop import GatedSilo, JobRun, run_gated


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    source: Literal["digits", "npz"] = "digits"
    path: Path | None = Field(None, description="folder of one .npz per silo (source = npz)")
    silos: Annotated[int, Field(ge=1)] = 10
    seed: int = 0
    mask_probability: Annotated[float, Field(ge=0, le=1)] = 0.1

    @model_validator(mode="after")
    def _path_for_npz(self) -> DataConfig:
        if self.source == "npz" and self.path is None:
            raise ValueError("data.path is required when data.source is 'npz'")
        return self


class DpSgdSettings(_Strict):
    lr: Annotated[float, Field(gt=0)] = 0.5
    clip_norm: Annotated[float, Field(gt=0)] = 1.0
    noise_multiplier: Annotated[float, Field(gt=0)] = 1.0
    batch_size: Annotated[int, Field(ge=1)] = 16
    local_steps: Annotated[int, Field(ge=1)] = 10
    seed: int = 0


class SiloKey(_Strict):
    id: int
    key: str | None = None
    key_env: str | None = None

    @model_validator(mode="after")
    def _one_key(self) -> SiloKey:
        if (self.key is None) == (self.key_env is None):
            raise ValueError(f"silo {self.id}: give exactly one of key and key_env")
        return self


class JobConfig(_Strict):
    url: str
    job_id: str = "job"
    algorithm: str = Field("mrmtl", description="the `name` of an algorithm of trainer.federated.registry.standalone()")
    rounds: Annotated[int, Field(ge=1)] = 20
    lam: Annotated[float, Field(ge=0)] = 1.0
    personal_steps: Annotated[int, Field(ge=1)] = 5
    alpha: Annotated[float, Field(gt=0)] = 1.0
    client_rate: Annotated[float, Field(gt=0, le=1)] = 1.0
    federated_rounds: Annotated[int, Field(ge=0)] = 10
    clusters: Annotated[int, Field(ge=1)] = 4
    cluster_fraction: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="IFCA selects in the first ⌈fraction·rounds⌉ rounds only (ifca_mrmtl: default 0.1)"
    )
    selection_noise_multiplier: Annotated[float, Field(gt=0)] = 1.0
    device: str = "cpu"
    data: DataConfig = DataConfig()
    dpsgd: DpSgdSettings = DpSgdSettings()
    silos: list[SiloKey]

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        known = registry.standalone()
        if value not in known:
            raise ValueError(f"algorithm must be one of {', '.join(known)}; found {value!r}")
        return value


# The job file's settings, by the constructor argument each fills (see `options`); an algorithm takes
# those its constructor names. Listed once here, they also make the README's table of algorithms.
JOB_FIELDS = {
    "lam": "lam",
    "personal_steps": "personal_steps",
    "alpha": "alpha",
    "client_rate": "client_rate",
    "federated_rounds": "federated_rounds",
    "clusters": "clusters",
    "selection": "selection_noise_multiplier",
    "selection_rounds": "cluster_fraction",
}
# A warm start that must end (ClusteredMRMTL's required selection_rounds) selects in the first 10% of
# rounds unless cluster_fraction says otherwise ("IFCA 5%"/"10%" of the personalization benchmark).
WARM_START_FRACTION = 0.1


def load_data(config: DataConfig) -> FederatedDataset:
    if config.source == "npz":
        assert config.path is not None
        return load_npz_folder(config.path, seed=config.seed)
    return make_rotated_masked_digits(n_silos=config.silos, seed=config.seed, mask_probability=config.mask_probability)


def algorithm_args(
    dataset: FederatedDataset, *, config: DPSGDConfig, device: str, noise_multipliers: Sequence[float] | None = None
) -> AlgorithmArgs:
    """The constructor arguments every algorithm shares, for `dataset` (its tensors, task and classes)."""
    tensors = dataset.tensors()
    # Spelled out rather than `**tensors`: strict mypy cannot rule out extra keys in a spread TypedDict.
    return {
        "x_train": tensors["x_train"], "y_train": tensors["y_train"], "x_test": tensors["x_test"], "y_test": tensors["y_test"],
        "task": "classification" if dataset.task == "classification" else "regression",
        "num_classes": dataset.n_classes, "config": config, "noise_multipliers": noise_multipliers, "device": device,
    }


def build(job: JobConfig, dataset: FederatedDataset) -> FederatedAlgorithm:
    common = algorithm_args(dataset, config=DPSGDConfig(**job.dpsgd.model_dump()), device=job.device)
    return registry.build(job.algorithm, common, settings(job))


def settings(job: JobConfig) -> dict[str, Any]:
    """The job's settings as constructor arguments (JOB_FIELDS), for the algorithm it names."""
    values: dict[str, Any] = {argument: getattr(job, field) for argument, field in JOB_FIELDS.items()}
    values["selection"] = ClusterSelection(noise_multiplier=job.selection_noise_multiplier)
    selection_rounds = registry.options(registry.standalone()[job.algorithm]).get("selection_rounds")
    fraction = job.cluster_fraction
    if fraction is None and selection_rounds is not None and selection_rounds.default is inspect.Parameter.empty:
        fraction = WARM_START_FRACTION
    # None: select in every round (IFCA's default).
    values["selection_rounds"] = None if fraction is None else clustering_rounds(fraction, job.rounds)
    return values


def algorithms_markdown() -> str:
    """The table of algorithms in the README (and `dpledger train --algorithms`), from the registry."""
    lines = [
        "| `algorithm` | class | job settings | per-round mechanism of silo k | deploys |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, cls in registry.algorithms().items():
        if cls.coordinated:
            used = "not a job: run with the coordinator of `trainer/grouped.py`"
        else:
            used = ", ".join(f"`{JOB_FIELDS[a]}`" for a in registry.options(cls) if a in JOB_FIELDS) or "-"
        lines.append(f"| `{name}` | `{cls.__name__}` | {used} | {cls.cost} | {cls.deploys} |")
    return "\n".join(lines)


def run_job(job: JobConfig, *, environ: Mapping[str, str]) -> JobRun:
    dataset = load_data(job.data)
    if len(job.silos) != len(dataset.silos):
        raise ValueError(f"silos lists {len(job.silos)} ledger silos for {len(dataset.silos)} data silos")
    keys = []
    for silo in job.silos:
        key = silo.key if silo.key is not None else environ.get(silo.key_env or "")
        if not key:
            raise ValueError(f"silo {silo.id}: environment variable {silo.key_env} is not set")
        keys.append(key)
    gated = [GatedSilo(s.id, LedgerClient(job.url, key)) for s, key in zip(job.silos, keys, strict=True)]
    try:
        return run_gated(build(job, dataset), gated, rounds=job.rounds, job_id=job.job_id)
    finally:
        for member in gated:
            member.client.close()
