"""What each side may configure, and from where.

A silo's own settings (its ledger, its id, the file holding its key, its data, its σ) come from its
SuperNode's `--node-config` and nowhere else: the run config is written by whoever submits the run
and reaches every node, so a value read from it could be set by the server side.

In Flower's simulation engine a virtual node's node config holds only `partition-id` and
`num-partitions` (Flower sets them); `SiloSettings.of_node` then reads partition k's silo settings
from entry k of the JSON list in the file that the environment variable `DPLEDGER_SIMULATION_NODES`
names, set on the machine that runs the simulation: still not from the run config.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dpledger.flower import family
from dpledger.trainer.federated.halves import Halves

ConfigValue = bool | float | int | str
SIMULATION_NODES_ENV = "DPLEDGER_SIMULATION_NODES"
PARTITION_ID = "partition-id"  # what Flower's simulation engine puts in a virtual node's node config


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names it."""


def _get(config: Mapping[str, ConfigValue], key: str, where: str) -> ConfigValue:
    if key not in config:
        raise SettingsError(f"{where}: missing {key!r}.")
    return config[key]


def _text(config: Mapping[str, ConfigValue], key: str, where: str) -> str:
    value = _get(config, key, where)
    if not isinstance(value, str) or not value:
        raise SettingsError(f"{where}: {key!r} must be a non-empty string. Found {value!r}.")
    return value


def _int(config: Mapping[str, ConfigValue], key: str, where: str, *, minimum: int) -> int:
    value = _get(config, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(f"{where}: {key!r} must be an integer >= {minimum}. Found {value!r}.")
    return value


def _bool(config: Mapping[str, ConfigValue], key: str, where: str) -> bool:
    value = _get(config, key, where)
    if not isinstance(value, bool):
        raise SettingsError(f"{where}: {key!r} must be true or false. Found {value!r}.")
    return value


def _float(config: Mapping[str, ConfigValue], key: str, where: str, *, positive: bool) -> float:
    value = _get(config, key, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SettingsError(f"{where}: {key!r} must be a finite number. Found {value!r}.")
    if value < 0 or (positive and value == 0):
        raise SettingsError(f"{where}: {key!r} must be {'> 0' if positive else '>= 0'}. Found {value!r}.")
    return float(value)


@dataclass(frozen=True)
class SiloSettings:
    """From `flower-supernode --node-config "ledger-url='…' silo-id=3 key-file='…' data-path='…' noise-multiplier=1.1"`."""

    ledger_url: str
    silo_id: int
    key_file: Path
    data_path: Path
    noise_multiplier: float
    # Where the silo keeps its own state after each round (a resumed run continues from it); by
    # default a folder beside its data file, `<data stem>-state`.
    state_dir: Path

    @classmethod
    def from_node_config(cls, config: Mapping[str, ConfigValue]) -> SiloSettings:
        where = "node config"
        data_path = Path(_text(config, "data-path", where))
        return cls(
            ledger_url=_text(config, "ledger-url", where),
            silo_id=_int(config, "silo-id", where, minimum=1),
            key_file=Path(_text(config, "key-file", where)),
            data_path=data_path,
            noise_multiplier=_float(config, "noise-multiplier", where, positive=True),
            state_dir=(Path(_text(config, "state-dir", where)) if "state-dir" in config
                       else data_path.with_name(data_path.stem + "-state")),
        )

    @classmethod
    def of_node(cls, config: Mapping[str, ConfigValue]) -> SiloSettings:
        """A SuperNode's settings from its node config; a virtual node's (simulation: `partition-id`
        only) from its entry in the file named by `DPLEDGER_SIMULATION_NODES`."""
        if "silo-id" in config or PARTITION_ID not in config:
            return cls.from_node_config(config)
        partition = _int(config, PARTITION_ID, "node config", minimum=0)
        path = os.environ.get(SIMULATION_NODES_ENV, "")
        where = f"{SIMULATION_NODES_ENV} {path!r}"
        if not path:
            raise SettingsError(f"node config: a virtual node (partition-id={partition}) needs {SIMULATION_NODES_ENV}, "
                                "the file of the simulated silos' settings.")
        try:
            entries = json.loads(Path(path).read_text())
        except OSError as error:
            raise SettingsError(f"{where} cannot be read ({error.strerror}).") from None
        except json.JSONDecodeError as error:
            raise SettingsError(f"{where} is not JSON ({error.msg}).") from None
        if not isinstance(entries, list) or partition >= len(entries) or not isinstance(entries[partition], dict):
            raise SettingsError(f"{where} must be a JSON list with an object for partition {partition}.")
        return cls.from_node_config(entries[partition])

    def api_key(self) -> str:
        """The key is read from its file when needed and never copied into any record or log."""
        return read_key_file(self.key_file, f"node config: 'key-file' {str(self.key_file)!r}")


FIRST_CONTACT_SECONDS = 600.0  # the app's default (pyproject.toml), where a run config leaves it out


@dataclass(frozen=True)
class RunSettings:
    """The run config (`[tool.flwr.app.config]`, overridden with `flwr run -c`): the algorithm (any
    of the registry's), its options, public training hyperparameters and the coordinator's own
    ledger access. Nothing in it is a silo's secret."""

    algorithm: str
    halves: Halves
    options: dict[str, ConfigValue]  # the algorithm's own options, copied into every train message
    rounds: int
    local_steps: int
    batch_size: int
    lr: float
    clip_norm: float
    seed: int
    min_nodes: int
    round_timeout: float
    # The first message to each SuperNode starts its first ClientApp process, which imports Flower,
    # torch and the app: on a busy machine that alone took minutes, far beyond a round's timeout.
    first_contact_timeout: float
    ledger_url: str
    coordinator_key_file: Path
    out: Path | None
    # Continue the stopped run whose checkpoint lies beside `out` (checkpoint.py) instead of starting a job.
    resume: bool

    @classmethod
    def from_run_config(cls, config: Mapping[str, ConfigValue]) -> RunSettings:
        where = "run config"
        algorithm = _text(config, "algorithm", where)
        out = config.get("out", "")
        if not isinstance(out, str):
            raise SettingsError(f"{where}: 'out' must be a path or ''. Found {out!r}.")
        try:
            # Built here once, so that a bad option fails the run before any silo is asked.
            halves = family.halves(config)
        except family.FamilyError as error:
            raise SettingsError(f"{where}: {error}") from None
        return cls(
            algorithm=algorithm,
            halves=halves,
            options={key: value for key, value in family.public_options(config).items() if isinstance(value, ConfigValue)},
            rounds=_int(config, "rounds", where, minimum=1),
            local_steps=_int(config, "local-steps", where, minimum=1),
            batch_size=_int(config, "batch-size", where, minimum=1),
            lr=_float(config, "lr", where, positive=True),
            clip_norm=_float(config, "clip-norm", where, positive=True),
            seed=_int(config, "seed", where, minimum=0),
            min_nodes=_int(config, "min-nodes", where, minimum=1),
            round_timeout=_float(config, "round-timeout", where, positive=True),
            first_contact_timeout=(_float(config, "first-contact-timeout", where, positive=True)
                                   if "first-contact-timeout" in config else FIRST_CONTACT_SECONDS),
            ledger_url=_text(config, "ledger-url", where),
            coordinator_key_file=Path(_text(config, "coordinator-key-file", where)),
            out=Path(out) if out else None,
            resume=_bool(config, "resume", where) if "resume" in config else False,
        )

    def fingerprint(self) -> dict[str, object]:
        """What makes a run the run it is: a resumed run must match it (rounds, timeouts, URLs, keys may change)."""
        return {"algorithm": self.algorithm, "options": self.options, "local-steps": self.local_steps,
                "batch-size": self.batch_size, "lr": self.lr, "clip-norm": self.clip_norm, "seed": self.seed}

    def coordinator_key(self) -> str:
        return read_key_file(self.coordinator_key_file, "run config: 'coordinator-key-file'")


def read_key_file(path: Path, where: str) -> str:
    """An API key from its file: the bare key (what `dpledger silos create` prints), or the JSON that
    `dpledger keys create` and `silos create --json` print, whose "api_key" holds it. Anything else is
    refused in one line that says so, never sent to the ledger to be answered with a 401."""
    try:
        text = path.read_text().strip()
    except OSError as error:
        raise SettingsError(f"{where} cannot be read ({error.strerror}).") from None
    except UnicodeDecodeError:
        raise SettingsError(f"{where} is not text; it must hold an API key.") from None
    if not text:
        raise SettingsError(f"{where} is empty.")
    if text[0] in '{["':  # JSON, not a key (a key never starts with these)
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise SettingsError(f"{where} starts with {text[0]!r} but is not JSON ({error.msg}).") from None
        key = document.get("api_key") if isinstance(document, dict) else None
        if not isinstance(key, str) or not key or any(c.isspace() for c in key):
            raise SettingsError(f"{where} is JSON without an \"api_key\" string (the field `dpledger keys create` prints).")
        return key
    if any(c.isspace() for c in text):
        raise SettingsError(f"{where} must hold the bare key or the JSON `dpledger keys create` prints. "
                            "Found more than one word.")
    return text
