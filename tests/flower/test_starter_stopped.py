"""A federation never outlives what started it: SIGTERM to the process holding `federation()` (a
test's or a bench's timeout) kills the ledger, the SuperLink, each SuperNode and everything they
started, by process group and descendants, before that process exits."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.flower.federation import descendants

ROOT = Path(__file__).resolve().parents[2]
STARTER = """
import sys, time
from pathlib import Path
from tests.flower.federation import federation
with federation(Path(sys.argv[1]), budgets=[5.0], noise_multiplier=1.0, train=40, test=10) as fed:
    print("started", flush=True)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its reaping is left


def test_sigterm_to_the_starter_stops_the_whole_federation(tmp_path: Path) -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert starter.stdout is not None and starter.stdout.readline() == "started\n", starter.communicate()
        deadline = time.monotonic() + 60
        started = descendants(starter.pid)
        # The ledger, the SuperLink, the SuperNode and the SuperExec the SuperNode starts itself.
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
            started = descendants(starter.pid)
        assert len(started) >= 4, started
        starter.send_signal(signal.SIGTERM)
        assert starter.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in started if alive(pid)] == []
    finally:
        if starter.poll() is None:  # the test failed with the starter alive: leave nothing behind
            for pid in [*descendants(starter.pid), starter.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            starter.wait()
