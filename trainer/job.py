"""`dpledger train`: a configured job against any ledger, from a TOML file or flags.

Each silo is named by its ledger id and its own key (given inline or, better, by the name of an
environment variable holding it), in the order of the data's silos. The job file is checked by
`job_config` and the ledger's view of every silo by `preflight`, both before this module (and so
torch) is imported.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

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
from dpledger.trainer.job_config import DataConfig, DpSgdSettings, JobConfig, SiloKey, silo_key
from dpledger.trainer.loop import GatedSilo, JobRun, Pause, RoundJournal, RoundRecord, Start, run_gated
from dpledger.trainer.preflight import LedgerSilo
from dpledger.wire.client import LedgerClient

__all__ = ["JOB_FIELDS", "DataConfig", "DpSgdSettings", "JobConfig", "SiloKey", "build", "load_data", "run_job"]


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


def build(job: JobConfig, dataset: FederatedDataset, *, device: str | None = None) -> FederatedAlgorithm:
    common = algorithm_args(dataset, config=DPSGDConfig(**job.dpsgd.model_dump()), device=device or job.device or "cpu")
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


def run_job(
    job: JobConfig,
    algorithm: FederatedAlgorithm,
    silos: Sequence[LedgerSilo],
    *,
    environ: Mapping[str, str],
    on_round: Callable[[RoundRecord], None] | None = None,
    start: Start | None = None,
    journal: RoundJournal | None = None,
    pause: Pause | None = None,
) -> JobRun:
    """The job's rounds from `start` (a resumed run's), kept round by round in `journal`; raises
    `Interrupted` on SIGINT once the round in flight is settled."""
    gated = [GatedSilo(s.id, LedgerClient(job.url, silo_key(entry, environ))) for s, entry in zip(silos, job.silos, strict=True)]
    try:
        return run_gated(algorithm, gated, rounds=job.rounds, job_id=job.job_id, on_round=on_round, start=start,
                         journal=journal, pause=pause)
    finally:
        for silo in gated:
            silo.client.close()


def write_outputs(
    out: Path, job: JobConfig, algorithm: FederatedAlgorithm, run: JobRun, silos: Sequence[LedgerSilo],
    after: Sequence[LedgerSilo | None],
) -> None:
    """models.pt (every silo's deployed model by ledger id, and the algorithm's whole state),
    metrics.jsonl (a line per round and silo) and summary.json (the job, the stop, per silo). Rounds count
    from 1 here, as in every line `train` prints; the ledger's charges keep the round's index (from 0)."""
    out.mkdir(parents=True, exist_ok=True)
    deployed = algorithm.deployed_parameters().detach().cpu()
    torch.save(
        {
            "algorithm": job.algorithm,
            "silo_ids": [s.id for s in silos],
            "deployed": {s.id: deployed[k].clone() for k, s in enumerate(silos)},
            "state": {name: t.detach().cpu() for name, t in algorithm.state().items()},
        },
        out / "models.pt",
    )
    with (out / "metrics.jsonl").open("w") as metrics:
        for record in run.rounds:
            for k, silo in enumerate(silos):
                metrics.write(json.dumps({
                    "round": record.round_index + 1, "silo_id": silo.id, "silo": silo.name,
                    "approved": record.approved[k], "refused": record.refused[k],
                    "epsilon_spent": record.epsilon_spent[k], "metric": _finite(record.metric[k]),
                    "update_norm": _finite(record.update_norms[k]),
                }) + "\n")
    summary = {
        "job": json.loads(job.model_dump_json(exclude={"silos"})) | {"silos": [s.id for s in job.silos]},
        "rounds_run": len(run.rounds),
        "stop_reason": run.stop_reason,
        "silos": [silo_summary(run, k, s, after[k]) for k, s in enumerate(silos)],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def silo_summary(run: JobRun, k: int, silo: LedgerSilo, after: LedgerSilo | None) -> dict[str, Any]:
    """`after`: the silo as the ledger shows it once the run ended (None if it could not be asked)."""
    refusal = run.refusals.get(k)
    return {
        "silo_id": silo.id, "name": silo.name, "budget": silo.epsilon,
        "epsilon_spent_before": silo.epsilon_spent, "epsilon_spent_after": None if after is None else after.epsilon_spent,
        "rounds_approved": run.approved_rounds()[k], "rounds_refused": run.refused_rounds()[k],
        "final_metric": _finite(run.rounds[-1].metric[k]) if run.rounds else None,
        "refused_at_round": None if refusal is None else refusal.round_index + 1,
        "epsilon_if_approved": None if refusal is None else refusal.epsilon_if_approved,
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
