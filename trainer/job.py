"""`dpledger train`: a configured job against any ledger, from a TOML file or flags.

Each silo is named by its ledger id and its own key (given inline or, better, by the name of an
environment variable holding it), in the order of the data's silos.

A job id is unique per run: without `job_id` each run gets a fresh one, so running the same file
twice spends twice (it never replays the first run's approvals). `resume = true` with the
`job_id` of an earlier run continues it on purpose: the rounds the ledger holds committed for that
job are skipped, not retrained.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dpledger.trainer.client import LedgerClient
from dpledger.trainer.data import FederatedDataset
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.data.npz import load_npz_folder
from dpledger.trainer.federated import (
    IFCA,
    MRMTL,
    PPSGD,
    ClusteredMRMTL,
    ClusterSelection,
    Ditto,
    DPSGDConfig,
    FedAvg,
    FederatedAlgorithm,
    Finetuning,
    LocalTraining,
    clustering_rounds,
)
from dpledger.trainer.loop import GatedSilo, JobRun, committed_rounds, run_gated


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
    job_id: str | None = Field(None, description="default: a fresh id per run; give the earlier run's id with resume")
    resume: bool = False
    algorithm: Literal["local", "fedavg", "mrmtl", "ditto", "ppsgd", "finetune", "ifca", "ifca_mrmtl"] = "mrmtl"
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

    @model_validator(mode="after")
    def _resume_names_its_run(self) -> JobConfig:
        if self.resume and self.job_id is None:
            raise ValueError("resume needs the job_id of the run it continues")
        return self


def new_job_id() -> str:
    return f"run-{uuid.uuid4().hex[:16]}"


def load_data(config: DataConfig) -> FederatedDataset:
    if config.source == "npz":
        assert config.path is not None
        return load_npz_folder(config.path, seed=config.seed)
    return make_rotated_masked_digits(n_silos=config.silos, seed=config.seed, mask_probability=config.mask_probability)


def build(job: JobConfig, dataset: FederatedDataset) -> FederatedAlgorithm:
    common = dict(
        **dataset.tensors(),
        task="classification" if dataset.task == "classification" else "regression",
        num_classes=dataset.n_classes, config=DPSGDConfig(**job.dpsgd.model_dump()), device=job.device,
    )
    match job.algorithm:
        case "local":
            return LocalTraining(**common)
        case "fedavg":
            return FedAvg(**common)
        case "mrmtl":
            return MRMTL(lam=job.lam, **common)
        case "ditto":
            return Ditto(lam=job.lam, personal_steps=job.personal_steps, **common)
        case "ppsgd":
            return PPSGD(alpha=job.alpha, client_rate=job.client_rate, **common)
        case "finetune":
            return Finetuning(federated_rounds=job.federated_rounds, **common)
        case "ifca" | "ifca_mrmtl":
            selection = ClusterSelection(noise_multiplier=job.selection_noise_multiplier)
            fraction = job.cluster_fraction if job.algorithm == "ifca" else job.cluster_fraction or 0.1
            selecting = None if fraction is None else clustering_rounds(fraction, job.rounds)
            if job.algorithm == "ifca":
                return IFCA(clusters=job.clusters, selection=selection, selection_rounds=selecting, **common)
            assert selecting is not None
            return ClusteredMRMTL(lam=job.lam, clusters=job.clusters, selection=selection, selection_rounds=selecting, **common)
    raise AssertionError(job.algorithm)


def run_job(job: JobConfig, *, environ: Mapping[str, str], say: Callable[[str], None] | None = None) -> JobRun:
    """`say` gets the lines a person should see before training: the job id, and each silo's
    training records, the most its registered dataset_size may be."""
    dataset = load_data(job.data)
    if len(job.silos) != len(dataset.silos):
        raise ValueError(f"silos lists {len(job.silos)} ledger silos for {len(dataset.silos)} data silos")
    keys = []
    for silo in job.silos:
        key = silo.key if silo.key is not None else environ.get(silo.key_env or "")
        if not key:
            raise ValueError(f"silo {silo.id}: environment variable {silo.key_env} is not set")
        keys.append(key)
    if job.resume:
        assert job.job_id is not None  # the model refuses resume without one
        job_id = job.job_id
    elif job.job_id is None:
        job_id = new_job_id()
    else:
        job_id = f"{job.job_id}-{uuid.uuid4().hex[:8]}"  # a name, made unique per run: never a silent replay
    if say is not None:
        say(f"job id: {job_id}" + (" (resumed)" if job.resume else ""))
        for silo, data in zip(job.silos, dataset.silos, strict=True):
            say(f"silo {silo.id}: {data.x_train.shape[0]} training records (its registered dataset_size must be at most this)")
    gated = [GatedSilo(s.id, LedgerClient(job.url, key)) for s, key in zip(job.silos, keys, strict=True)]
    try:
        done = dict(enumerate(committed_rounds(gated, job_id=job_id))) if job.resume else None
        return run_gated(build(job, dataset), gated, rounds=job.rounds, job_id=job_id, done=done)
    finally:
        for silo in gated:
            silo.client.close()
