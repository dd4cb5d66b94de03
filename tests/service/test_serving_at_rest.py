"""A serving process at rest (service/serving.py _QuietServer): its event loop wakes about once a
second, where uvicorn's own loop woke ten times a second to look for an exit; the Date header it
refreshes on those wake-ups stays current, and SIGTERM still stops it.

Counted, not timed: the main thread's voluntary context switches (each wake-up from its event loop's
wait is one), which a busy machine delays but does not multiply."""

from __future__ import annotations

import signal
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx
import pytest

from dpledger.harness import ServerProcess

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")


def wake_ups(pid: int) -> int:
    """The voluntary context switches of the process's main thread so far."""
    for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/task/{pid}/status")


def test_a_server_at_rest_wakes_about_once_a_second_and_stops_at_sigterm(tmp_path: Path) -> None:
    server = ServerProcess(database_url=f"sqlite:///{tmp_path}/ledger.db", admin_key="at-rest-admin-key-0123456789abcdef")
    server.start()
    try:
        assert server.process is not None
        pid = server.process.pid
        time.sleep(2.0)  # what the start-up and the health check left to do
        first, started = wake_ups(pid), time.monotonic()
        time.sleep(8.0)
        rate = (wake_ups(pid) - first) / (time.monotonic() - started)
        assert rate <= 3.0, f"the main thread woke {rate:.1f} times a second at rest (uvicorn's own loop: ~10)"

        answered = httpx.get(f"{server.url}/healthz", timeout=30)
        assert abs(time.time() - parsedate_to_datetime(answered.headers["date"]).timestamp()) < 5

        server.process.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then raises the signal it caught again: the exit a SIGTERM asks for.
        assert server.process.wait(timeout=30) == -signal.SIGTERM
    finally:
        server.kill()
