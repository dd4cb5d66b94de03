"""Exactly once across interruptions: a job's checkpoint, and how `dpledger train --resume` reads it
with the ledger's charges.

Per round, in the job's output folder (`trainer.loop.RoundJournal`):

- `progress.json`, written (atomically, fsynced) before the round's training may touch data: the
  round that did. Its absence proves that a reserved round never read anything.
- `checkpoint.pkl`, written after the round trained and before its charges are committed: the
  algorithm whole (every silo's model, the server's state, every random stream, so a resumed run
  draws what an uninterrupted one would) and the run's records. The silos' data is not in it: it
  is read again from the job's data and put back in place.

On resume each silo's charges of the job are read (its own key) and settled by the one settle rule
(`trainer/silo/rounds.py`): a reserved charge of a round the checkpoint holds is committed (it trained);
one of the round that began training and was not checkpointed stays spent (committed) and that
round is trained again under a charge of its own (`round_key(..., charge=n)`), so the ledger's
history shows both; one of a round whose training never began is released. A committed round the
checkpoint does not hold (the folder was lost or is another's) is refused: it would be paid twice.

The checkpoint is a pickle: `--resume` trusts the output folder as it trusts the job file (this
job's own run wrote both).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpledger.trainer.federated import FederatedAlgorithm
from dpledger.trainer.job_config import JobConfig, silo_key
from dpledger.trainer.loop import JobRun, Start
from dpledger.trainer.preflight import LedgerSilo
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Rejected

CHECKPOINT, PROGRESS = "checkpoint.pkl", "progress.json"
FORMAT = 1
# What may change between a run and its resumption; everything else must be the same job.
_MAY_CHANGE = {"url", "device", "resume", "rounds", "silos"}


class ResumeError(Exception):
    """Why a job cannot be resumed, one line each."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def fingerprint(job: JobConfig) -> dict[str, Any]:
    """The settings that make the job what it is (never a key: the silos by id only)."""
    settings: dict[str, Any] = json.loads(job.model_dump_json(exclude=_MAY_CHANGE))
    return settings | {"silos": [s.id for s in job.silos]}


def write_atomic(path: Path, data: bytes) -> None:
    """All of `data` at `path` or the old file untouched, durable before it returns."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _Pickler(pickle.Pickler):
    """Pickles the algorithm without its silos' data (restored from the job's data on load)."""

    def __init__(self, file: io.BytesIO, algorithm: FederatedAlgorithm) -> None:
        super().__init__(file, protocol=5)
        self._data = {id(algorithm.train): "train", id(algorithm.test): "test"}

    def persistent_id(self, obj: Any) -> str | None:
        return self._data.get(id(obj))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fresh: FederatedAlgorithm) -> None:
        super().__init__(file)
        self._data = {"train": fresh.train, "test": fresh.test}

    def persistent_load(self, pid: Any) -> Any:
        return self._data[str(pid)]


@dataclass
class Checkpoint:
    completed: int  # the last round (from 0) it holds; -1: none trained yet
    algorithm: FederatedAlgorithm
    run: JobRun


def dumps(job: JobConfig, completed: int, algorithm: FederatedAlgorithm, run: JobRun) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, algorithm).dump({"format": FORMAT, "job_id": job.job_id, "job": fingerprint(job),
                                      "device": str(algorithm.device), "completed": completed,
                                      "algorithm": algorithm, "run": run})
    return buffer.getvalue()


def loads(data: bytes, fresh: FederatedAlgorithm) -> dict[str, Any]:
    loaded: dict[str, Any] = _Unpickler(io.BytesIO(data), fresh).load()
    return loaded


class Journal:
    """The job's `RoundJournal` in its output folder; keeps the last checkpoint's bytes too, from
    which an interrupted run writes its outputs as of the last completed round."""

    def __init__(self, out: Path, job: JobConfig, algorithm: FederatedAlgorithm, *, completed: int = -1,
                 run: JobRun | None = None) -> None:
        self.out, self.job = out, job
        out.mkdir(parents=True, exist_ok=True)
        self.last = dumps(job, completed, algorithm,
                          run if run is not None else JobRun(job.job_id, stopped=[False] * algorithm.num_silos))

    def training(self, round_index: int) -> None:
        record = {"job_id": self.job.job_id, "training": round_index}
        write_atomic(self.out / PROGRESS, (json.dumps(record) + "\n").encode())

    def completed(self, round_index: int, algorithm: FederatedAlgorithm, run: JobRun) -> None:
        self.last = dumps(self.job, round_index, algorithm, run)
        write_atomic(self.out / CHECKPOINT, self.last)

    def restore(self, fresh: FederatedAlgorithm) -> Checkpoint:
        """The algorithm and run as of the last completed round (over `fresh`'s data)."""
        loaded = loads(self.last, fresh)
        return Checkpoint(loaded["completed"], loaded["algorithm"], loaded["run"])


def read_checkpoint(out: Path, job: JobConfig, fresh: FederatedAlgorithm) -> Checkpoint | None:
    """The job's checkpoint in `out` (None if there is none); raises ResumeError if it is another job's."""
    path = out / CHECKPOINT
    if not path.exists():
        return None
    loaded = loads(path.read_bytes(), fresh)
    problems = []
    if loaded.get("format") != FORMAT:
        problems.append(f"{path}: written by another version of dpledger (format {loaded.get('format')!r})")
    elif loaded["job_id"] != job.job_id:
        problems.append(f"{path} is job {loaded['job_id']!r}'s, not {job.job_id!r}'s: give --out the folder of this job")
    else:
        changed = sorted(k for k, v in fingerprint(job).items() if loaded["job"].get(k) != v)
        if changed:
            problems.append(f"the job file changed since {path} was written ({', '.join(changed)}): "
                            "a resumed job must be the same job (only rounds, url and device may change)")
        if loaded["device"] != str(fresh.device):
            problems.append(f"{path} was trained on {loaded['device']}; resume it there (device = \"{loaded['device']}\")")
    if problems:
        raise ResumeError(problems)
    return Checkpoint(loaded["completed"], loaded["algorithm"], loaded["run"])


def read_training(out: Path, job_id: str) -> int | None:
    """The round whose training began last (progress.json), or None."""
    try:
        record = json.loads((out / PROGRESS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    training = record.get("training")
    return training if record.get("job_id") == job_id and isinstance(training, int) else None


@dataclass(frozen=True)
class Charge:
    """One charge of the job, as the ledger lists it."""

    charge_id: int
    status: ChargeStatus
    round: int


@dataclass
class SiloResume:
    """What resuming does with one silo's charges of the job."""

    commit: list[Charge] = field(default_factory=list)  # reserved, and its round read data: spent
    release: list[Charge] = field(default_factory=list)  # reserved, and its round's training never began
    again: list[Charge] = field(default_factory=list)  # spent on a round not checkpointed: trained again
    charges: dict[int, int] = field(default_factory=dict)  # round → charges it has (the next one's number)
    problems: list[str] = field(default_factory=list)


def reconcile(charges: Sequence[Charge], *, completed: int, training: int | None) -> SiloResume:
    """The one settle rule, applied afresh to one silo's charges of the job, given the last round the
    checkpoint holds (`completed`, -1: none) and the round whose training began last (`training`)."""
    out = SiloResume()
    lost = training if training is not None and training > completed else None  # read data, not checkpointed
    for charge in sorted(charges, key=lambda c: c.charge_id):
        out.charges[charge.round] = out.charges.get(charge.round, 0) + 1
        if charge.status is ChargeStatus.released:
            continue
        held = charge.round <= completed
        if charge.status is ChargeStatus.reserved:
            (out.commit if held or charge.round == lost else out.release).append(charge)
        if not held and charge.round == lost:
            out.again.append(charge)
        elif not held and charge.status is ChargeStatus.committed:
            out.problems.append(f"round {charge.round + 1}'s charge {charge.charge_id} is committed but the checkpoint "
                                f"holds {'no round' if completed < 0 else f'rounds up to {completed + 1}'}")
    return out


def start(checkpoint: Checkpoint | None, silos: Sequence[SiloResume]) -> Start:
    """Where the resumed loop begins, and under which charge number each of its rounds reserves."""
    charges: Mapping[tuple[int, int], int] = {
        (round_index, k): count for k, silo in enumerate(silos) for round_index, count in silo.charges.items()
    }
    if checkpoint is None:
        return Start(charges=charges)
    run = checkpoint.run
    # A refusal is final; how the earlier process ended (a failure, an interrupt) is not this run's.
    run.stopped = [k in run.refusals for k in range(len(run.stopped))]
    run.failed, run.stop_reason, run.interrupted = False, None, None
    return Start(first_round=checkpoint.completed + 1, run=run, charges=charges)


@dataclass
class Prepared:
    """A resumption, its charges settled: where the loop starts, the algorithm to continue, and
    what was done, one line each."""

    start: Start
    algorithm: FederatedAlgorithm
    completed: int
    lines: list[str]


def prepare(job: JobConfig, silos: Sequence[LedgerSilo], fresh: FederatedAlgorithm, out: Path,
            environ: Mapping[str, str]) -> Prepared:
    """Reads the checkpoint in `out` and each silo's charges of the job, settles the open ones by
    the one settle rule, and says where the run continues. Raises ResumeError (nothing settled) or
    a LedgerError."""
    checkpoint = read_checkpoint(out, job, fresh)
    completed = -1 if checkpoint is None else checkpoint.completed
    training = read_training(out, job.job_id)
    clients = [LedgerClient(job.url, silo_key(entry, environ)) for entry in job.silos]
    try:
        plans = []
        for silo, client in zip(silos, clients, strict=True):
            charges = [Charge(c.charge_id, ChargeStatus(c.status), c.round) for c in client.charges(silo.id)
                       if c.job_id == job.job_id and c.round is not None]
            plans.append(reconcile(charges, completed=completed, training=training))
        problems = [f"{silo.label}: {p}" for silo, plan in zip(silos, plans, strict=True) for p in plan.problems]
        if problems:
            raise ResumeError([*problems, f"{out} is not the output folder of the run that spent them (--out): "
                               "resuming from it would train and pay for those rounds twice"])
        lines = []
        for silo, client, plan in zip(silos, clients, plans, strict=True):
            for charge in plan.commit:
                client.commit(charge.charge_id)  # None: an earlier settlement had landed, committed all the same
            released, kept = [], []
            for charge in plan.release:
                try:
                    client.release(charge.charge_id)
                    released.append(charge)
                except Rejected:  # the ledger knows better (an output of the round reached it): spent
                    client.commit(charge.charge_id)
                    kept.append(charge)
            held = [c for c in plan.commit if c.round <= completed]
            if held:
                lines.append(f"{silo.label}: {_ids(held)} committed (the checkpoint holds {_their(held)} training)")
            again = plan.again + [c for c in kept if c not in plan.again]
            if again:
                stay = "stays" if len(again) == 1 else "stay"
                lines.append(f"{silo.label}: {_ids(again)} of round {again[0].round + 1} {stay} spent (it may have read "
                             "data and was not checkpointed); that round is trained again under a new charge")
            if released:
                lines.append(f"{silo.label}: {_ids(released)} released (the round's training never began)")
    finally:
        for client in clients:
            client.close()
    algorithm = fresh if checkpoint is None else checkpoint.algorithm
    return Prepared(start(checkpoint, plans), algorithm, completed, lines)


def _ids(charges: Sequence[Charge]) -> str:
    return ("charge " if len(charges) == 1 else "charges ") + ", ".join(str(c.charge_id) for c in charges)


def _their(charges: Sequence[Charge]) -> str:
    return "its round's" if len(charges) == 1 else "their rounds'"
