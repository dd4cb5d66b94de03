"""The registry of algorithms is read off the classes, and the job file, the CLI and the README use it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from dpledger import worker_cli
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import IFCA, ClusteredMRMTL, Ditto, FederatedAlgorithm, registry
from dpledger.trainer.federated.base import REGISTERED
from dpledger.trainer.job import JOB_FIELDS, WARM_START_FRACTION, JobConfig, algorithms_markdown, build
from tests.trainer import wire

ROOT = Path(__file__).resolve().parents[2]
SILO = {"id": 1, "key": "k"}


def named_subclasses(cls: type[FederatedAlgorithm]) -> set[type[FederatedAlgorithm]]:
    found = set()
    for sub in cls.__subclasses__():
        if "name" in sub.__dict__ and sub.__module__.startswith("dpledger.trainer."):
            found.add(sub)
        found |= named_subclasses(sub)
    return found


def test_the_registry_is_every_class_that_names_itself() -> None:
    assert {cls.__name__ for cls in registry.algorithms().values()} == {
        "LocalTraining", "FedAvg", "MRMTL", "Ditto", "PPSGD", "Finetuning", "IFCA", "ClusteredMRMTL", "PFA", "FedHDP",
        "PMTL",
    }
    assert set(registry.algorithms().values()) == named_subclasses(FederatedAlgorithm)
    assert all(name == cls.name for name, cls in registry.algorithms().items())
    # The coordinated ones need set_groups() between rounds: no plain job may name them.
    assert set(registry.algorithms()) - set(registry.standalone()) == {"pfa", "fedhdp"}


def test_a_second_class_with_a_taken_name_or_without_its_cost_is_refused() -> None:
    before = dict(REGISTERED)
    with pytest.raises(TypeError, match="two algorithms named 'mrmtl'"):
        type("Impostor", (IFCA,), {"name": "mrmtl", "cost": "-", "deploys": "-"})
    with pytest.raises(TypeError, match="must say its per-round cost"):
        type("Silent", (IFCA,), {"name": "silent"})
    assert before == REGISTERED


def test_every_required_option_of_a_job_algorithm_is_a_job_setting() -> None:
    for name, cls in registry.standalone().items():
        required = {p for p, parameter in registry.options(cls).items() if parameter.default is parameter.empty}
        assert required <= JOB_FIELDS.keys(), name


def test_the_job_builds_each_algorithm_from_its_settings() -> None:
    dataset = make_rotated_masked_digits(n_silos=2, seed=0, mask_probability=0.1)
    for name, cls in registry.standalone().items():
        job = JobConfig(url="http://x", algorithm=name, rounds=30, lam=0.25, personal_steps=3, silos=[SILO, SILO])
        algorithm = build(job, dataset)
        assert type(algorithm) is cls
    ditto = build(JobConfig(url="http://x", algorithm="ditto", lam=0.25, personal_steps=3, silos=[SILO]), dataset)
    assert isinstance(ditto, Ditto) and (ditto.silo.lam, ditto.silo.personal_steps) == (0.25, 3)  # type: ignore[attr-defined]
    assert [m["steps"] for m in wire(ditto.round_mechanisms(0)) if m is not None] == [10 + 3, 10 + 3]
    # IFCA selects in every round unless told; the warm start of ifca_mrmtl must end, after 10% of the rounds.
    ifca = build(JobConfig(url="http://x", algorithm="ifca", rounds=30, silos=[SILO]), dataset)
    warm = build(JobConfig(url="http://x", algorithm="ifca_mrmtl", rounds=30, silos=[SILO]), dataset)
    short = build(JobConfig(url="http://x", algorithm="ifca", rounds=30, cluster_fraction=0.2, silos=[SILO]), dataset)
    assert isinstance(ifca, IFCA) and ifca.silo.selection_rounds is None  # type: ignore[attr-defined]
    assert isinstance(warm, ClusteredMRMTL) and warm.silo.warm_start_rounds == math.ceil(WARM_START_FRACTION * 30) == 3
    assert isinstance(short, IFCA) and short.silo.selection_rounds == 6  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["pfa", "fedhdp", "nope"])
def test_a_job_naming_no_job_algorithm_is_refused_with_the_choices(name: str) -> None:
    with pytest.raises(ValidationError, match=re.escape("algorithm must be one of ditto, fedavg, finetune, ifca,")):
        JobConfig(url="http://x", algorithm=name, silos=[SILO])


def test_the_cli_offers_the_registry_and_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_cli.main(["train", "--algorithms"]) == 0
    assert capsys.readouterr().out.strip() == algorithms_markdown()
    with pytest.raises(SystemExit):
        worker_cli.main(["train", "--algorithm", "pfa"])
    assert "invalid choice: 'pfa'" in capsys.readouterr().err


def test_the_readme_table_is_the_registrys() -> None:
    readme = (ROOT / "docs" / "guides" / "silo.md").read_text()
    block = readme.split("<!-- algorithms: begin -->\n", 1)[1].split("\n<!-- algorithms: end -->", 1)[0]
    assert block == algorithms_markdown()
    for name, cls in registry.algorithms().items():
        assert f"| `{name}` | `{cls.__name__}` |" in block
