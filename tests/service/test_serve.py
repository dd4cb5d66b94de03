"""`dpledger serve` on a fresh directory with nothing configured but an admin key."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from service.server import free_port

KEY = "serve-test-admin-key-0123456789"


def test_serve_migrates_the_default_sqlite_file_and_answers(tmp_path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DPLEDGER_DATABASE_URL")}
    env["DPLEDGER_ADMIN_KEY"] = KEY
    process = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port)], cwd=tmp_path, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "serve did not answer"
                time.sleep(0.2)
        created = httpx.post(
            f"http://127.0.0.1:{port}/v1/silos", headers={"Authorization": f"Bearer {KEY}"},
            json={"name": "clinic", "epsilon": 1.0, "delta": 1e-5, "dataset_size": 100},
        )
        assert created.status_code == 201
        assert (tmp_path / "dpledger.db").exists()
    finally:
        process.terminate()
        process.wait(timeout=20)
