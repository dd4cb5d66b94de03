"""pyproject's explicit package list matches the folders: a folder with an __init__.py that is not
listed would be missing from a plain (non-editable) install, as dpledger.wire once was."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject_and_nothing_else() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: set[str] = set()
    for name, folder in setuptools["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    listed: list[str] = setuptools["packages"]
    assert len(set(listed)) == len(listed), "a package is listed twice"
    assert sorted(found) == sorted(listed)


HEAVY = ("flwr", "ray", "playwright", "mypy", "opacus", "pytest", "schemathesis")  # none is the demo's


def _first_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return readme.split("```\n", 2)[1].splitlines()


def test_the_readmes_first_line_installs_the_worker_alone_and_its_second_the_dev_extra() -> None:
    demo, tests = _first_block()[:2]
    assert "-e '.[worker]'" in demo and demo.endswith("&& .venv/bin/dpledger demo")
    assert "-e '.[worker,dev]'" in tests and tests.endswith("&& .venv/bin/python -m pytest")  # .ci/run runs this line
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    light = [*project["dependencies"], *project["optional-dependencies"]["worker"]]
    names = {requirement.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower() for requirement in light}
    assert not names & set(HEAVY), names & set(HEAVY)


def test_the_demo_imports_nothing_that_the_light_install_lacks() -> None:
    """What `dpledger demo` loads, in a fresh interpreter: torch and the base dependencies only."""
    import subprocess
    import sys

    probe = ("import sys\nfrom dpledger import cli, demo, worker_cli\nfrom dpledger.trainer import report\n"
             "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT,
                                timeout=120).stdout.split())
    assert "torch" in loaded and not loaded & set(HEAVY), loaded & set(HEAVY)
