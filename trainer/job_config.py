"""The job file of `dpledger train`, checked whole before anything heavy is imported.

pydantic and the standard library only (no torch, no numpy): a mistake in the file is found in
well under a second and said as one line per mistake, not as a traceback after torch has loaded.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The names of trainer.federated.registry.standalone(), written out so that a job file is checked
# without importing torch; tests/trainer/test_train.py keeps the two equal.
ALGORITHMS: tuple[str, ...] = ("ditto", "fedavg", "finetune", "ifca", "ifca_mrmtl", "local", "mrmtl", "pmtl", "ppsgd")


class JobFileError(Exception):
    """Everything wrong with a job file, one problem a line."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class _Strict(BaseModel):
    # strict: a value is taken as the type TOML wrote it. `rounds = "20"` or `rounds = 20.0` is a
    # mistake said before anything is spent, never a guess (an int is still a float: `lam = 1`).
    model_config = ConfigDict(extra="forbid", strict=True)


class DataConfig(_Strict):
    source: Literal["digits", "npz"] = "digits"
    # TOML has no path type: the string it holds (strict=False only lets str become Path).
    path: Annotated[Path, Field(strict=False)] | None = Field(None, description="folder of one .npz per silo (source = npz)")
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
    id: Annotated[int, Field(ge=1)]
    key: str | None = None
    key_env: str | None = None

    @model_validator(mode="after")
    def _one_key(self) -> SiloKey:
        if (self.key is None) == (self.key_env is None):
            raise ValueError(f"silo {self.id}: give exactly one of key and key_env")
        return self

    @property
    def key_source(self) -> str:
        """Where the key comes from, as the messages name it (never the key itself)."""
        return f"${self.key_env}" if self.key_env else f"the inline key of silo {self.id}"


class JobConfig(_Strict):
    url: str
    job_id: Annotated[str, Field(min_length=1, max_length=150)] = "job"
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
    device: str | None = Field(None, description="cpu or cuda; default: cuda when present")
    resume: bool = Field(False, description="continue this job_id's run from its output folder (as --resume)")
    data: DataConfig = DataConfig()
    dpsgd: DpSgdSettings = DpSgdSettings()
    silos: Annotated[list[SiloKey], Field(min_length=1)]

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        if value not in ALGORITHMS:
            close = difflib.get_close_matches(value, ALGORITHMS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; found {value!r}{hint}")
        return value


def _fields(model: type[BaseModel], location: Sequence[int | str]) -> list[str]:
    """The keys allowed at `location` (for "did you mean"), following nested models and lists."""
    for part in location:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        candidates = (annotation, *getattr(annotation, "__args__", ()))
        nested = next((a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return list(model.model_fields)


def _where(location: Sequence[int | str]) -> str:
    parts: list[str] = []
    for part in location:
        if isinstance(part, int):
            parts[-1] = f"{parts[-1]}[{part}]" if parts else f"[{part}]"
        else:
            parts.append(str(part))
    return ".".join(parts)


# pydantic's error kinds for a value of the wrong type, as the messages name the type wanted.
_TYPE_NAMES = {"int_type": "an integer", "float_type": "a number", "string_type": "a string", "bool_type": "true or false",
               "model_type": "a table", "list_type": "a list", "dict_type": "a table"}
_TOML_TYPES: dict[type, str] = {int: "an integer", float: "a float", bool: "a boolean", list: "a list", dict: "a table"}


def _wrong_type(kind: str, location: Sequence[int | str], found: Any) -> str:
    """The value as TOML wrote it, and the fix where the value was only quoted: `rounds = "20"`."""
    if not isinstance(found, str):
        spelled = str(found).lower() if isinstance(found, bool) else repr(found)
        return f"{spelled} ({_TOML_TYPES.get(type(found), type(found).__name__)})"
    number = kind in ("int_type", "float_type")
    try:
        unquoted = number and (int(found) if kind == "int_type" else float(found)) is not None
    except ValueError:
        unquoted = False
    key = str(next((p for p in reversed(location) if isinstance(p, str)), ""))
    return f"the string {found!r}" + (f" (write it without quotes: {key} = {found.strip()})" if unquoted else "")


def describe(error: ValidationError) -> list[str]:
    """One line per mistake, each naming the key as it is written in the file."""
    problems = []
    for item in error.errors():
        location = [p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-after"))]
        kind, message = item["type"], item["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            *parent, unknown = location
            close = difflib.get_close_matches(str(unknown), _fields(JobConfig, parent), n=1)
            hint = f" (did you mean {_where([*parent, close[0]])}?)" if close else ""
            problems.append(f"{_where(location)}: unknown key{hint}")
        elif kind in _TYPE_NAMES:
            problems.append(f"{_where(location)}: must be {_TYPE_NAMES[kind]}, not {_wrong_type(kind, location, item['input'])}")
        elif kind == "missing" and location == ["silos"]:
            problems.append("silos: missing: add one [[silos]] table (id, key_env) per data silo, in the data's order")
        else:
            named = str(location[-1]) if location else ""
            # "algorithm: algorithm must be …" reads once as "algorithm: must be …"
            problems.append(f"{_where(location) or 'job'}: {message.removeprefix(named + ' ') if named else message}")
    return problems


def load_job(path: Path | None, *, overrides: Mapping[str, Any], environ: Mapping[str, str]) -> JobConfig:
    """The job file (if any) with `overrides` on top, checked whole; raises JobFileError."""
    settings: dict[str, Any] = {}
    if path is not None:
        try:
            settings = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise JobFileError(["no such file"]) from None
        except (OSError, UnicodeDecodeError) as error:
            raise JobFileError([f"cannot read it: {error}"]) from None
        except tomllib.TOMLDecodeError as error:
            raise JobFileError([f"not valid TOML: {error}"]) from None
    settings.update({k: v for k, v in overrides.items() if v is not None})
    try:
        job = JobConfig.model_validate(settings)
    except ValidationError as error:
        # What can be checked on the raw values is said too, so one run lists every mistake.
        raise JobFileError(describe(error) + _raw_problems(settings, environ)) from None
    problems = _problems(job, environ)
    if problems:
        raise JobFileError(problems)
    return job


def _problems(job: JobConfig, environ: Mapping[str, str]) -> list[str]:
    problems = []
    ids = [s.id for s in job.silos]
    for silo_id in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"silos: id {silo_id} is listed {ids.count(silo_id)} times")
    for index, silo in enumerate(job.silos):
        if silo.key_env is not None and not environ.get(silo.key_env):
            problems.append(f"silos[{index}] (id {silo.id}): the environment variable {silo.key_env} is not set")
    if not job.url.startswith(("http://", "https://")):
        problems.append(f"url: {job.url!r} is not an http:// or https:// URL")
    data_silos = _data_silos(job.data, problems)
    if data_silos is not None and data_silos != len(job.silos):
        problems.append(
            f"silos: {len(job.silos)} [[silos]] tables for {data_silos} data silos: give one per data silo, in order"
        )
    return problems


def _raw_problems(settings: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """The checks of `_problems` that need no valid model: unset key variables, a missing folder."""
    problems = []
    silos = settings.get("silos")
    for index, silo in enumerate(silos if isinstance(silos, list) else []):
        name = silo.get("key_env") if isinstance(silo, dict) else None
        if isinstance(name, str) and not environ.get(name):
            problems.append(f"silos[{index}] (id {silo.get('id')}): the environment variable {name} is not set")
    data = settings.get("data")
    if isinstance(data, dict) and data.get("source") == "npz" and isinstance(data.get("path"), str):
        if not Path(data["path"]).is_dir():
            problems.append(f"data.path: {data['path']} is not a folder (expected one .npz file per silo)")
    return problems


def _data_silos(data: DataConfig, problems: list[str]) -> int | None:
    """How many silos the data holds, from the file names alone (the files are read later)."""
    if data.source == "digits":
        return data.silos
    assert data.path is not None
    if not data.path.is_dir():
        problems.append(f"data.path: {data.path} is not a folder (expected one .npz file per silo)")
        return None
    files = sorted(data.path.glob("*.npz"))
    if not files:
        problems.append(f"data.path: {data.path} holds no .npz files (expected one per silo)")
        return None
    return len(files)


def silo_key(silo: SiloKey, environ: Mapping[str, str]) -> str:
    key = silo.key if silo.key is not None else environ.get(silo.key_env or "")
    if not key:  # load_job has said so already; kept for callers that skip it
        raise JobFileError([f"silo {silo.id}: {silo.key_source} is not set"])
    return key
