"""A real uvicorn server in a child process on 127.0.0.1, for the demo, benches and load tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from dpledger.service.store.db import migrate

# How long a server may take to answer /healthz: 4 workers importing the app on a machine ~10×
# oversubscribed took over 60 s once (a CI run); a server that answers returns at once.
STARTUP_SECONDS = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(*, database_url: str, admin_key: str, workers: int = 1,
                   startup_timeout: float = STARTUP_SECONDS) -> Iterator[str]:
    """Migrates, starts `uvicorn` with `workers` processes, yields the base URL, stops it on exit."""
    with ServerProcess(
        database_url=database_url, admin_key=admin_key, workers=workers, startup_timeout=startup_timeout
    ) as server:
        yield server.url


class ServerProcess:
    """A uvicorn server that can be SIGKILLed and restarted on the same port and database, for crash
    tests: an answered approval must survive the kill of every process that might have held it."""

    def __init__(
        self, *, database_url: str, admin_key: str, workers: int = 1, port: int | None = None,
        startup_timeout: float = STARTUP_SECONDS,
    ) -> None:
        self.database_url = database_url
        self.admin_key = admin_key
        self.workers = workers
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self._migrated = False

    def start(self) -> None:
        """Starts the server (migrating first, once) and returns when it answers /healthz."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the server on {self.url} is running already")
        if not self._migrated:
            migrate(self.database_url)
            self._migrated = True
        env = {**os.environ, "DATABASE_URL": self.database_url, "DPLEDGER_ADMIN_KEY": self.admin_key}
        command = [
            sys.executable, "-m", "dpledger.service.serving", "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", str(self.workers), "--log-level", "warning",
        ]
        # A session of its own, so that kill() reaches the master and every worker it spawned, and
        # nothing else.
        self.process = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            _wait_until_healthy(self.url, self.process, self.startup_timeout)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL to the whole process group: no worker gets to finish or roll back anything."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None

    def stop(self) -> None:
        """Graceful stop (SIGTERM to the master, which stops its workers); SIGKILL after 20 s."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # also reaps any worker the master left behind

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


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
