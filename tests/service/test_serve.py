"""`dpledger serve` on a fresh directory with nothing configured but an admin key."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx

from dpledger.harness import free_port

KEY = "serve-test-admin-key-0123456789"


def test_serve_migrates_the_default_sqlite_file_and_answers(tmp_path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DPLEDGER_DATABASE_URL")}
    env["DPLEDGER_ADMIN_KEY"] = KEY
    process = subprocess.Popen(
        [sys.executable, "-m", "dpledger.cli", "serve", "--port", str(port)], cwd=tmp_path, env=env,
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

    from dpledger.service.api.app import create_app
    from dpledger.service.settings import Settings

    url = f"sqlite:///{tmp_path}/keys.db"
    env = {**os.environ, "DATABASE_URL": url}
    env.pop("DPLEDGER_ADMIN_KEY", None)
    out = subprocess.run(
        [sys.executable, "-m", "dpledger.cli", "keys", "create", "--role", "admin"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    key = json.loads(out.stdout)["api_key"]

    app = create_app(Settings(database_url=url, admin_key=None))
    with TestClient(app) as client:
        assert client.get("/v1/silos", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.get("/v1/silos", headers={"Authorization": "Bearer dpl_guess"}).status_code == 401
    app.state.engine.dispose()


def test_serve_with_two_workers_sums_metrics_across_processes_and_logs_json(tmp_path) -> None:
    """Two uvicorn workers on one SQLite file, prometheus_client in multiprocess mode: `/metrics`,
    whichever worker answers, counts every approval once; every log line is JSON and holds no key."""
    port = free_port()
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DPLEDGER_DATABASE_URL")}
    env.update(DPLEDGER_ADMIN_KEY=KEY, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "dpledger.cli", "serve", "--port", str(port), "--workers", "2"],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
        try:
            # Each worker creates its counter file when it builds the app: two files, two live workers.
            deadline = time.monotonic() + 90
            while len(list(metrics_dir.glob("counter_*.db"))) < 2 or not _healthy(url):
                assert time.monotonic() < deadline and process.poll() is None, "two workers did not start"
                time.sleep(0.2)
            admin = {"Authorization": f"Bearer {KEY}"}
            silo = httpx.post(f"{url}/v1/silos", headers=admin,
                              json={"name": "clinic", "epsilon": 10.0, "delta": 1e-5, "dataset_size": 1000}).json()
            step = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}
            for i in range(8):  # a new connection each time, so the kernel spreads them over the workers
                response = httpx.post(
                    f"{url}/v1/silos/{silo['id']}/charges",
                    json={"mechanism": step, "idempotency_key": f"k{i}"},
                    headers={"Authorization": f"Bearer {silo['api_key']}"},
                )
                assert response.status_code == 201

            text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text  # decisions: admin only
            public = httpx.get(f"{url}/metrics").text
        finally:
            process.terminate()
            process.wait(timeout=20)

    assert 'dpledger_charge_decisions_total{outcome="approved",reason="reserved"} 8.0' in text
    assert "dpledger_charge_decisions" not in public and "dpledger_http_request_duration_seconds_count" in public
    assert (
        'dpledger_http_request_duration_seconds_count{method="POST",route="/v1/silos/{silo_id}/charges",status_class="2xx"} 8.0'
        in text
    )
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert {"uvicorn.error", "dpledger.access"} <= {line["logger"] for line in lines}
    assert sum(line.get("outcome") == "approved" for line in lines if line["logger"] == "dpledger.access") == 8
    assert KEY not in log.read_text() and silo["api_key"] not in log.read_text()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_every_worker_connection_has_nagle_off() -> None:
    """The listener that `serve --workers N` shares with its workers hands out connections with
    TCP_NODELAY (service/serving.py: without it each keep-alive request waits ~40 ms for a delayed ACK)."""
    import asyncio
    import socket

    from dpledger.service.serving import _NoDelayConfig

    config = _NoDelayConfig("dpledger.service.api.app:create_app", factory=True, host="127.0.0.1", port=0, workers=2)
    listener = config.bind_socket()
    assert listener.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted = transport.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(accept_one())
    assert seen and seen[0] != 0


def _dpledger(args: list[str], *, cwd, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DPLEDGER_") and k != "DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "dpledger.cli", *args], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


def test_serve_settings_errors_are_one_line_and_exit_2(tmp_path) -> None:
    weak = _dpledger(["serve"], cwd=tmp_path, DPLEDGER_ENV="production", DPLEDGER_ADMIN_KEY="short")
    assert (weak.returncode, weak.stdout) == (2, "")
    assert weak.stderr == "dpledger serve: settings: DPLEDGER_ADMIN_KEY must be at least 24 characters in production\n"

    env = _dpledger(["serve"], cwd=tmp_path, DPLEDGER_ENV="staging")
    assert env.returncode == 2 and env.stderr.startswith("dpledger serve: settings: DPLEDGER_ENV: Input should be")
    assert env.stderr.count("\n") == 1

    url = _dpledger(["serve"], cwd=tmp_path, DATABASE_URL="nonsense://x")
    assert url.returncode == 2 and url.stderr.startswith("dpledger serve: DATABASE_URL is not a database URL")
    assert url.stderr.count("\n") == 1

    down = _dpledger(["migrate"], cwd=tmp_path, DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:9/x")
    assert down.returncode == 2 and down.stderr.startswith("dpledger migrate: the database (DATABASE_URL) refused:")
    assert down.stderr.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing was created on the way

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = _dpledger(["serve", "--port", str(port)], cwd=tmp_path)
    assert busy.returncode == 2
    assert busy.stderr == f"dpledger serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_init_prints_the_first_admin_key_once_and_refuses_a_second_time(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from dpledger.service.api.app import create_app
    from dpledger.service.settings import Settings

    first = _dpledger(["init"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    key = first.stdout.strip()
    assert first.stdout == key + "\n" and key.startswith("dpl_")
    again = _dpledger(["init"], cwd=tmp_path)
    assert (again.returncode, again.stdout) == (2, "")
    assert again.stderr == (
        "dpledger init: sqlite:///./dpledger.db has an admin key already; `dpledger keys create --role admin` makes another\n"
    )
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path}/dpledger.db", admin_key=None))
    with TestClient(app) as client:
        assert client.get("/v1/silos", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    app.state.engine.dispose()


def test_a_served_app_is_frozen_out_of_the_collectors_reach(tmp_path) -> None:
    # What a serving process builds lives as long as it: a full collection must not walk it again.
    url = f"sqlite:///{tmp_path}/frozen.db"
    subprocess.run([sys.executable, "-m", "dpledger.cli", "migrate"], env={**os.environ, "DATABASE_URL": url},
                   check=True, capture_output=True)
    probe = ("import gc; from dpledger.service.serving import served_app; "
             "before = gc.get_freeze_count(); app = served_app(); print(before, gc.get_freeze_count(), type(app).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "DATABASE_URL": url}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert before == 0 and after > 10_000, out  # the app's modules and objects: tens of thousands
    assert out[2] == "FastAPI"
