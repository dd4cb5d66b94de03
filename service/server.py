"""A real uvicorn server in a child process on 127.0.0.1, for the demo, benches and load tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from service.ledger.db import migrate


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(*, database_url: str, admin_key: str, workers: int = 1, startup_timeout: float = 60.0) -> Iterator[str]:
    """Migrates, starts `uvicorn` with `workers` processes, yields the base URL, stops it on exit."""
    migrate(database_url)
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, "DPLEDGER_ADMIN_KEY": admin_key}
    command = [
        sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory",
        "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers), "--log-level", "warning",
    ]
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(url, process, startup_timeout)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before answering")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server did not answer on {url} within {timeout} s")
