"""The benches' bulk seeder (bench/_seeding.py) writes what a loop of `charges.reserve` (and
`charges.commit`) writes: the same silo columns, charge rows and entries, chains that audit and log
leaves that match their records. A change to what an approval writes that the seeder does not follow
fails here, not silently in a bench's numbers (bench/approvals.py's first step failed that way once:
its seeder predated the filter a silo's first charge fixes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def seeding() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_seeding", BENCH / "_seeding.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_seeding"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("database_url", "commit"), [("sqlite", False), ("sqlite", True), ("postgres", True)],
                         indirect=["database_url"])
def test_bulk_seeding_writes_what_a_loop_of_reserve_writes(database_url: str, commit: bool) -> None:
    # 9 charges: the first through reserve() (it fixes the silo's filter), then batches of 4 and 4,
    # over four (q, σ) pairs: a batch meets pairs it priced before and pairs it has not.
    said = seeding().check(database_url, count=9, commit=commit, batch=4)
    assert said.startswith("bulk seeding == a loop of reserve()")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_check_finds_a_seeder_that_writes_otherwise(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = seeding()
    append = module._append_batch

    def another_job(*args: object, **kw: object) -> None:  # every bulk charge under another job id
        append(*args, **{**kw, "job_id": "other"})

    monkeypatch.setattr(module, "_append_batch", another_job)
    with pytest.raises(RuntimeError, match=r"differs from a loop of reserve\(\): \['charges'"):
        module.check(database_url, count=5, batch=2)
