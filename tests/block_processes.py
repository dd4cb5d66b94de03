"""The processes a pasted README block started, for the tests that run one verbatim (the tour, the
Flower federation): found by session or by working folder, and killed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest


def started_in(folder: Path, session: int) -> list[int]:
    """Live processes the block started: in its shell's session, or with their cwd in or under its
    folder (the SuperLink starts its SuperExec in a session of its own). Zombies are dead already."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        in_folder = cwd == str(folder) or cwd.startswith(f"{folder}{os.sep}")
        if stat[0] != "Z" and (int(stat[3]) == session or in_folder):
            found.append(int(entry.name))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def log_tails(folder: Path, names: tuple[str, ...], lines: int = 25) -> str:
    """The last lines of the logs the block wrote in `folder`, for a failure's message."""
    shown = []
    for name in names:
        path = folder / name
        if path.exists():
            shown.append(f"\n--- {name} (last {lines} lines)\n" + "\n".join(path.read_text(errors="replace")
                                                                          .splitlines()[-lines:]))
    return "".join(shown)


def run_block(script: Path, *, folder: Path, env: dict[str, str], log: Path, timeout: float,
              logs: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Runs a pasted block as written (`bash -eu`: a failing step stops it there, an unset variable is an
    error) in `folder`, its output to `log`; returns the finished shell, or fails the test past `timeout`
    after killing what the block started (showing the end of its output and of its logs named in
    `logs`). The caller kills what it leaves running (`started_in`)."""
    with log.open("wb") as out:
        shell = subprocess.Popen(["bash", "-eu", str(script)], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        shell.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(started_in(folder, shell.pid))
        pytest.fail(f"the block ran past {timeout:.0f} s:\n{log.read_text()[-4000:]}{log_tails(folder, logs)}")
    return shell
