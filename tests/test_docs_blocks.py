"""Every fenced block of the README and the documentation site either runs in a test or says that it
is an illustration, and every block parses in its language: shell with `bash -n`, Python with
`ast.parse`, TOML with tomllib, JSON with the standard decoder.

A shell block (fenced ```bash, ```sh, ```console or with no language) carries, in the HTML comments
right above its fence, `<!-- runs-in: PATH -->` (PATH a test, or the CI script, that reads this
markdown file and runs the block) or `<!-- illustration -->`. Also: the README stays short enough to
read in five minutes, and every page of docs/ is in the site's navigation."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"", "bash", "sh", "shell", "console"}
PICTURES = {"text"}  # diagrams and printed output: nothing to run or parse
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*(runs-in:\s*(\S+)|illustration)\s*-->$")
README_MAX_LINES = 250


@dataclass(frozen=True)
class Block:
    source: str  # the markdown file, relative to the repository root
    line: int  # the fence's line, from 1
    language: str
    code: str
    runs_in: tuple[str, ...]
    illustration: bool


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)]


def blocks(text: str, source: str) -> list[Block]:
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(opening.group(1))), None)
        assert end is not None, f"{source}:{i + 1}: a fence that never closes"
        runs_in: list[str] = []
        illustration = False
        k = i - 1
        while k >= 0 and lines[k].startswith("<!--"):  # the comments right above the fence
            marker = MARKER.match(lines[k].strip())
            if marker:
                if marker.group(2):
                    runs_in.append(marker.group(2))
                else:
                    illustration = True
            k -= 1
        found.append(Block(source, i + 1, opening.group(2).lower(), "\n".join(lines[i + 1 : end]) + "\n",
                           tuple(runs_in), illustration))
        i = end + 1
    return found


def problems(block: Block) -> list[str]:
    """What is wrong with one block: an empty list when it is fine."""
    where = f"{block.source}:{block.line}"
    if block.language in SHELL:
        if bool(block.runs_in) == block.illustration:
            return [f"{where}: a shell block needs exactly one of <!-- runs-in: TEST --> or <!-- illustration --> above it"]
        for target in block.runs_in:
            path = ROOT / target
            if not path.is_file():
                return [f"{where}: runs-in names {target}, which does not exist"]
            if Path(block.source).name not in path.read_text() and block.source not in path.read_text():
                return [f"{where}: {target} never reads {block.source}"]
        checked = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, timeout=30)
        return [f"{where}: bash -n: {checked.stderr.strip()}"] if checked.returncode else []
    try:
        if block.language == "python":
            ast.parse(block.code)
        elif block.language == "toml":
            tomllib.loads(block.code)
        elif block.language == "json":  # one or more JSON values in a row
            decoder, text, at = json.JSONDecoder(), block.code, 0
            while text[at:].strip():
                at = len(text) - len(text[at:].lstrip())
                at = decoder.raw_decode(text, at)[1]
        elif block.language not in PICTURES:
            return [f"{where}: a block in {block.language!r}, which this test does not know how to check"]
    except (SyntaxError, tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        return [f"{where}: {block.language} does not parse: {error}"]
    return []


def all_blocks() -> list[Block]:
    return [b for path in markdown_files() for b in blocks(path.read_text(), str(path.relative_to(ROOT)))]


def test_every_block_of_the_readme_and_the_docs_runs_in_a_test_or_is_an_illustration_and_parses() -> None:
    found = all_blocks()
    assert len(found) >= 15 and {b.source for b in found} >= {"README.md", "docs/guides/consortium.md"}
    assert [p for b in found for p in problems(b)] == []


def test_the_checker_finds_each_kind_of_mistake(tmp_path: Path) -> None:
    text = ("```bash\necho unmarked\n```\n\n<!-- runs-in: tests/no_such_test.py -->\n```\necho x\n```\n\n"
            "<!-- runs-in: tests/test_planes.py -->\n```sh\necho x\n```\n\n<!-- illustration -->\n```bash\nif then\n```\n\n"
            "```python\ndef f(:\n```\n\n```toml\nrounds = \n```\n\n```json\n{\"a\": 1}\n{\"b\":\n```\n\n```yaml\na: 1\n```\n\n"
            "<!-- illustration -->\n```console\nfor k in 1 2; do echo $k; done\n```\n")
    found = [problems(b) for b in blocks(text, "docs/example.md")]
    assert [bool(p) for p in found] == [True, True, True, True, True, True, True, True, False]
    assert "exactly one of" in found[0][0] and "does not exist" in found[1][0] and "never reads" in found[2][0]
    assert "bash -n" in found[3][0] and "python does not parse" in found[4][0] and "'yaml'" in found[7][0]


def test_the_readme_is_read_in_five_minutes_and_keeps_its_two_commands_first() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    first = blocks(readme, "README.md")[0]
    assert first.code.splitlines()[1].endswith("&& .venv/bin/python -m pytest") and first.runs_in == (".ci/run",)


def test_every_page_of_the_docs_is_in_the_sites_navigation() -> None:
    yaml = pytest.importorskip("yaml")  # mkdocs' own dependency, in the dev extra
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return []

    listed = pages(config["nav"])
    on_disk = [str(p.relative_to(ROOT / "docs")) for p in markdown_files()[1:]]
    assert sorted(listed) == sorted(on_disk)
