"""What a Flower run keeps so that it can be continued: the ServerApp's checkpoint after each round
it aggregated, and each silo's own state after each round it trained.

The ServerApp's checkpoint (beside the run's `out` JSON, `<out stem>.checkpoint`) holds the ledger
job, the run's key, how many times the run was started, the rounds aggregated, the run's log and
the server half whole (a pickle: `resume = true` trusts it as `dpledger train --resume` trusts its
output folder; this run's own ServerApp wrote it). A resumed run reuses the job, starts at the first
round not aggregated and numbers its charges anew (`attempt`), so a round a silo was training when
the run stopped stays spent and is trained again under a charge of its own.

A silo's state (its personal model, Ditto's or MR-MTL's) is written after each round it trained to
its own folder (node config `state-dir`), keyed by the run's key: a resumed run's ClientApp, a new
process in a new Flower run, starts from the state of the last round before the one it is asked.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpledger.trainer.federated.halves import Arrays, ServerHalf
from dpledger.trainer.resume import write_atomic

FORMAT = 1
SUFFIX = ".checkpoint"
RUN_KEY = re.compile(r"[0-9a-f]{16}")  # what a run's key looks like (the only name a silo's state file takes)


class ResumeRefused(RuntimeError):
    """Why a run cannot be resumed (its message is the one line)."""


def path_for(out: Path) -> Path:
    """Where a run whose out JSON is `out` keeps its checkpoint."""
    return out.with_name(out.stem + SUFFIX)


@dataclass
class ServerCheckpoint:
    job_id: int
    run_key: str
    attempt: int  # 0 for a run's first start, +1 at each resumption
    fingerprint: dict[str, Any]  # the settings that make the run what it is (rounds may change)
    completed: int  # rounds aggregated
    run: Any  # the ServerApp's RunLog (kept opaque here: the app owns its type)
    job_silos: list[int]  # the job's silo ids, in the server half's order
    active: list[int]  # silo ids that have not declined
    server: ServerHalf

    def save(self, path: Path) -> None:
        buffer = io.BytesIO()
        pickle.dump({"format": FORMAT, **self.__dict__}, buffer, protocol=5)
        write_atomic(path, buffer.getvalue())


def load(path: Path, fingerprint: dict[str, Any]) -> ServerCheckpoint:
    """The checkpoint at `path` for a run of these settings; ResumeRefused says in one line why not."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ResumeRefused(f"resume: no checkpoint at {path} (a run writes it beside its out JSON after each "
                            "round; give the stopped run's out)") from None
    try:
        loaded: dict[str, Any] = pickle.loads(data)  # this run's own ServerApp wrote it (module docstring)
    except Exception as error:  # a truncated or foreign file: whatever unpickling raises
        raise ResumeRefused(f"resume: {path} is not a checkpoint ({type(error).__name__})") from None
    if not isinstance(loaded, dict) or loaded.get("format") != FORMAT:
        raise ResumeRefused(f"resume: {path} was written by another version of dpledger")
    loaded.pop("format")
    changed = sorted(k for k in fingerprint.keys() | loaded["fingerprint"].keys()
                     if fingerprint.get(k) != loaded["fingerprint"].get(k))
    if changed:
        raise ResumeRefused(f"resume: the run config changed since {path} was written ({', '.join(changed)}); "
                            "a resumed run must be the same run (only rounds, timeouts and URLs may change)")
    return ServerCheckpoint(**loaded)


class SiloStates:
    """A silo's own state after each round it trained, one file per run (its key) in `folder`;
    the last two rounds are kept: a round trained again after an interruption starts from the
    state before it, as an uninterrupted run would have."""

    KEEP = 2

    def __init__(self, folder: Path, run_key: object) -> None:
        if not isinstance(run_key, str) or not RUN_KEY.fullmatch(run_key):
            raise ValueError(f"train config 'run-key' must be 16 hex digits. Found {run_key!r}.")
        self.path = folder / f"run-{run_key}.pt"

    def _read(self) -> dict[int, Arrays]:
        try:
            stored: dict[int, Arrays] = torch.load(self.path, weights_only=True)
        except FileNotFoundError:
            return {}
        return stored

    def before(self, round_index: int) -> Arrays | None:
        """The state after the last round trained before `round_index` (None: this run's first)."""
        stored = self._read()
        earlier = [r for r in stored if r < round_index]
        return stored[max(earlier)] if earlier else None

    def latest(self) -> Arrays | None:
        stored = self._read()
        return stored[max(stored)] if stored else None

    def save(self, round_index: int, state: Arrays) -> None:
        stored = {r: s for r, s in self._read().items() if r < round_index}
        stored[round_index] = {k: v.detach().cpu() for k, v in state.items()}
        kept = dict(sorted(stored.items())[-self.KEEP:])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(kept, buffer)
        write_atomic(self.path, buffer.getvalue())

