"""A shared server for a test's processes: this process and what it starts pinned to one core, where
busy processes make up the load that the machine's own does not.

The load is governed, not fixed: once a second the governor counts what else wants the core (the
runnable processes there that neither it nor its descendants started, and the share the hypervisor
steals from it) and lets only as many busy processes run as make the core `per_core` + 1 ways
shared. A test measures its block on a machine that busy, never on that load stacked on a machine
that is busy already (a CI host whose own load once made a federation block seven times slower)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
GOVERN_SECONDS = 1.0
# The foreign load is averaged over about this many readings: one reading sees an instant only.
SMOOTHING = 4
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the busy child before it runs: killed when this process ends, even while it is stopped
    (SIGSTOP, which the governor sends and under which its own parent check never runs)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextmanager
def on_one_core() -> Iterator[int]:
    """This process, and so every process it starts meanwhile, on one CPU (yielded); this process
    itself only waits for them."""
    cpus = os.sched_getaffinity(0)
    core = max(cpus)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, cpus)


def _stat(path: Path) -> list[str] | None:
    """A /proc stat line's fields after the command's name: state is [0], ppid [1], the CPU it last
    ran on [36]."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def foreign_runnable(core: int, mine: int) -> int:
    """Runnable threads that last ran on `core` and belong to no descendant of process `mine`."""
    parents, runnable = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry / "stat")) is not None:
            parents[int(entry.name)] = int(fields[1])
            runnable[int(entry.name)] = entry
    count = 0
    for pid, entry in runnable.items():
        ancestor = pid
        while ancestor > 1 and ancestor != mine:
            ancestor = parents.get(ancestor, 1)
        if ancestor == mine:
            continue
        try:
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            fields = _stat(task / "stat")
            if fields is not None and fields[0] == "R" and int(fields[36]) == core:
                count += 1
    return count


def _core_times(core: int) -> tuple[int, int]:
    """(all, stolen) jiffies of `core` since boot, from /proc/stat."""
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name == f"cpu{core}":
            ticks = [int(v) for v in values]
            return sum(ticks[:8]), ticks[7]
    return 0, 0


@contextmanager
def shared(core: int, per_core: int) -> Iterator[list[int]]:
    """Busy processes on `core`, governed so that with the machine's own load `per_core` others want
    it; yields a list that holds, reading by reading, how many ran. Each spins until it is killed or
    its parent (this process) is gone, running or stopped, so none outlives a killed test."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=_die_with_parent) for _ in range(per_core)]
    running = list(busy)
    stop, history = threading.Event(), [per_core]

    def govern() -> None:
        foreign, last = 0.0, _core_times(core)
        while not stop.wait(GOVERN_SECONDS):
            now = _core_times(core)
            ticks, stolen = now[0] - last[0], now[1] - last[1]
            last = now
            share_stolen = min(0.9, stolen / ticks) if ticks > 0 else 0.0
            # A core the hypervisor runs 1 - s of the time serves its runnable ones as if s / (1 - s)
            # more of them shared it.
            wanting = foreign_runnable(core, os.getpid()) + share_stolen / (1 - share_stolen) * (per_core + 1)
            foreign += (wanting - foreign) / SMOOTHING
            wanted = max(0, min(per_core, round(per_core - foreign)))
            while len(running) > wanted:
                os.kill(running.pop().pid, signal.SIGSTOP)
            while len(running) < wanted:
                process = busy[len(running)]
                os.kill(process.pid, signal.SIGCONT)
                running.append(process)
            history.append(wanted)

    governor = threading.Thread(target=govern, daemon=True)
    governor.start()
    try:
        yield history
    finally:
        stop.set()
        governor.join()
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()
