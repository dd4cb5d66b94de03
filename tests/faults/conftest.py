"""Shared pieces of the fault tests: a `dpledger serve` process that can be stopped and restarted on
its port and database, process trees found through /proc and killed, and a ledger client that reads a
silo's charges as an operator would (GET /v1/silos/{id}/charges)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from dpledger.harness import free_port
from tests.flower.federation import descendants, wait_http

BIN = Path(sys.executable).parent
T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], *, timeout: float, interval: float = 0.05, what: str = "the condition") -> T:
    """The first truthy value of `predicate()`, polled until `timeout` seconds have passed (then fails the test)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(interval)


class LedgerServer:
    """`dpledger serve` on 127.0.0.1 in a session of its own, on a fixed port and SQLite file, so that
    it can be stopped (SIGTERM or SIGKILL) and started again where it was."""

    def __init__(self, folder: Path, *, admin_key: str, port: int | None = None) -> None:
        self.folder = folder
        self.admin_key = admin_key
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = f"sqlite:///{folder / 'ledger.db'}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        self.starts += 1
        env = {**os.environ, "DATABASE_URL": self.database_url, "DPLEDGER_ADMIN_KEY": self.admin_key}
        with (self.folder / f"ledger-{self.starts}.log").open("wb") as log:
            self.process = subprocess.Popen([str(BIN / "dpledger"), "serve", "--port", str(self.port)], env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"{self.url}/healthz", self.process, timeout)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.process is None:
            return
        stop_tree(self.process, sig, timeout=timeout)
        self.process = None

    def __enter__(self) -> LedgerServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop(signal.SIGKILL)


# --- processes ---------------------------------------------------------------------------------------
def command_line(pid: int) -> list[str]:
    try:
        return [part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part]
    except OSError:
        return []


def named(pid: int, name: str) -> bool:
    """Whether `pid` runs the program `name` (`flwr-clientapp`, `flower-superexec`, …) and is not a zombie."""
    try:
        if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z":
            return False
    except (OSError, IndexError):
        return False
    return any(Path(part).name == name for part in command_line(pid)[:2])


def sender_of(port: int) -> int | None:
    """The process holding the local end 127.0.0.1:`port` of a TCP connection (the client that sent a
    request the proxy holds): its socket's inode from /proc/net/tcp, then whose fd points at it."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}":
            inodes.add(fields[9])
    targets = {f"socket:[{inode}]" for inode in inodes if inode != "0"}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in targets:
                    return int(entry.name)
        except OSError:
            continue
    return None


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_tree(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL, *, timeout: float = 20.0) -> None:
    """`sig` to the process, its process group and every descendant; SIGKILL to all after `timeout` s."""
    tree = descendants(process.pid)
    signal_all([process.pid, *tree], sig)
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    signal_all([process.pid, *tree, *descendants(process.pid)], signal.SIGKILL)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=timeout)


# --- the ledger as an operator reads it ----------------------------------------------------------------
def listed_charges(url: str, admin_key: str, silo_id: int, **query: str) -> list[dict[str, Any]]:
    """GET /v1/silos/{id}/charges (e.g. status='reserved', job_id='7') with an admin key."""
    answer = httpx.get(f"{url}/v1/silos/{silo_id}/charges", params=query, timeout=10.0,
                       headers={"Authorization": f"Bearer {admin_key}"})
    answer.raise_for_status()
    charges = answer.json()
    assert isinstance(charges, list)
    return charges


@pytest.fixture
def no_receipts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Receipts of in-process clients go to the test's folder, not the home directory."""
    folder = tmp_path / "receipts"
    monkeypatch.setenv("DPLEDGER_RECEIPTS", str(folder))
    yield folder
