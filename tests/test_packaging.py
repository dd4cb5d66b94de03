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
