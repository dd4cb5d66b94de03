"""A regular (non-editable) install serves: `pip install --no-deps --target` of a copy of the source,
then that copy's `dpledger serve` migrates a fresh SQLite file from the shipped revisions and answers
/healthz and /docs' assets, with nothing of the source tree on the path. Plus the static parts of the
image: the Dockerfile installs without -e in production mode and .dockerignore keeps the context small."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from email.parser import Parser
from pathlib import Path

import httpx

from dpledger.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "dpledger", "service", "trainer", "migrations")
KEY = "install-test-admin-key-0123456789"


def test_a_plain_install_migrates_and_serves_from_the_installed_package_alone(tmp_path: Path) -> None:
    source, target, work = tmp_path / "src", tmp_path / "site", tmp_path / "work"
    source.mkdir()
    work.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    # --no-build-isolation: the virtualenv's setuptools builds it, so the test needs no network.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        check=True, timeout=300, capture_output=True,
    )
    top_level = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")} - {"bin"}
    assert top_level == {"dpledger"}  # one namespaced import name: no `service` or `trainer` beside it
    assert sorted(p.name for p in (target / "dpledger" / "migrations" / "versions").glob("0*.py"))
    (dist_info,) = target.glob("dpledger-*.dist-info")
    metadata = Parser().parsestr((dist_info / "METADATA").read_text())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Apache License" in (dist_info / "licenses" / "LICENSE").read_text()

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPLEDGER_", "DATABASE_URL", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(target), DATABASE_URL=f"sqlite:///{work}/ledger.db", DPLEDGER_ADMIN_KEY=KEY,
               DPLEDGER_ENV="production", DPLEDGER_SIGNING_KEY="07" * 32)  # production signs the log: a key is required
    where = subprocess.run([sys.executable, "-c", "import dpledger.migrations as m; print(m.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(target))  # the installed copy, not the working tree
    process = subprocess.Popen([str(target / "bin" / "dpledger"), "serve", "--port", str(port)], cwd=work, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                assert time.monotonic() < deadline, "serve did not answer within 60 s"
                time.sleep(0.2)
        assert health.json() == {"status": "ok"}
        created = httpx.post(f"http://127.0.0.1:{port}/v1/silos", headers={"Authorization": f"Bearer {KEY}"},
                             json={"name": "clinic", "epsilon": 1.0, "delta": 1e-5, "dataset_size": 100})
        assert created.status_code == 201  # the shipped revisions created every table
        assert httpx.get(f"http://127.0.0.1:{port}/docs-assets/swagger-ui-bundle.js").status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_the_image_installs_without_editable_mode_in_production_and_its_context_is_small() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [line.split()[1:-1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert sorted(name for names in copied for name in names) == sorted(SOURCES)
    install = next(line for line in dockerfile.splitlines() if "pip install" in line)
    assert " -e " not in install and "--editable" not in install
    assert "DPLEDGER_ENV=production" in dockerfile
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "**/__pycache__", "*.db", "tests", "bench"} <= ignored
    assert not ignored & set(SOURCES)
