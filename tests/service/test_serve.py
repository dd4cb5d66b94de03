"""`dpledger serve` on a fresh directory with nothing configured but an admin key."""

from __future__ import annotations

import json
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


def test_keys_create_bootstraps_an_admin_without_any_env_key(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from service.settings import Settings

    url = f"sqlite:///{tmp_path}/keys.db"
    env = {**os.environ, "DATABASE_URL": url}
    env.pop("DPLEDGER_ADMIN_KEY", None)
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "keys", "create", "--role", "admin"], env=env, capture_output=True, text=True, check=True
    )
    key = json.loads(out.stdout)["api_key"]

    app = create_app(Settings(database_url=url, admin_key=None))
    with TestClient(app) as client:
        assert client.get("/v1/silos", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.get("/v1/silos", headers={"Authorization": "Bearer dpl_guess"}).status_code == 401
    app.state.engine.dispose()
