"""`dpledger flwr-run`: Flower's `flwr run`, ending with the run's outcome as its exit code.

`flwr run --stream` (Flower 1.41) exits 0 whatever became of the run: it streams the logs and never
reads the run's status, so a script that starts a federation cannot tell a ServerApp that failed or
was killed from one that finished. This runs `flwr run APP [SUPERLINK] … --stream` with the
arguments as given, then asks the same SuperLink for the run's status (`flwr ls --run-id`, so it
holds for a remote SuperLink too) and exits 0 for `finished:completed`, 1 for any other end (the
ServerApp raised: nothing trained, a refused resume…; or it was killed, which Flower 1.41 reports
as `finished:failed` too) with one line naming the status, and `flwr run`'s own code when that
failed. Stopped itself (SIGINT, SIGTERM), it stops `flwr run` and exits 130; the run goes on at the
SuperLink, as after Ctrl-C in `flwr run`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

STARTED = re.compile(r"Successfully started run (\d+)")
EXIT_FAILED, EXIT_STOPPED = 1, 130
# A run whose log stream ended is finished at the SuperLink within moments; this bounds the wait.
STATUS_WAIT_SECONDS = 30.0
# One `flwr ls` imports Flower in a new process: seconds on a quiet machine, minutes on a starved core
# (one beside busy processes took over 120 s). Past this the status is "unknown", said in one line.
LS_TIMEOUT_SECONDS = 240.0


def _flwr() -> str:
    """The `flwr` beside this Python (the environment dpledger runs in), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "flwr")
    return beside if os.access(beside, os.X_OK) else (shutil.which("flwr") or "flwr")


def _status(run_id: int, superlink: Sequence[str], timeout: float) -> tuple[str, str, bool]:
    """(status, details, answered): the run's status as the SuperLink reports it, or ("", why, …) when
    it cannot be read; `answered` is False when `flwr ls` itself did not end within `timeout`."""
    try:
        listed = subprocess.run([_flwr(), "ls", *superlink, "--run-id", str(run_id), "--format", "json"],
                                capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "", f"`flwr ls` did not answer within {timeout:g} s", False
    except OSError as error:
        return "", f"`flwr ls` did not start: {error}", False
    try:
        runs = json.loads(listed.stdout)["runs"]
        return str(runs[0]["status"]), str(runs[0].get("status-details") or ""), True
    except (ValueError, KeyError, IndexError, TypeError):
        said = (listed.stdout + listed.stderr).strip().splitlines()
        return "", said[-1] if said else "no answer", True


def main(argv: Sequence[str]) -> int:
    """`argv` as `flwr run` takes it: APP, then SUPERLINK if given, then options."""
    positional = [a for a in argv[:2] if not a.startswith("-")]
    superlink = positional[1:2]
    command = [_flwr(), "run", *argv, *([] if "--stream" in argv else ["--stream"])]
    # In this process's group: whatever stops the group (Ctrl-C, `kill -- -PGID`) stops flwr run too.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(signum: int, _frame: FrameType | None) -> None:
        process.terminate()
        print(f"dpledger flwr-run: stopped by {signal.Signals(signum).name}; the run goes on at the SuperLink "
              "(`flwr stop RUN_ID` ends it)", file=sys.stderr)
        sys.exit(EXIT_STOPPED)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    run_id: int | None = None
    try:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            found = STARTED.search(line)
            if found and run_id is None:
                run_id = int(found.group(1))
        code = process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code != 0 or run_id is None:
        return code or EXIT_FAILED
    deadline = time.monotonic() + STATUS_WAIT_SECONDS
    status, details, answered = _status(run_id, superlink, LS_TIMEOUT_SECONDS)
    # Asked again while the run is not finished yet, but not after a `flwr ls` that never ended.
    while answered and not status.startswith("finished") and time.monotonic() < deadline:
        time.sleep(1.0)
        status, details, answered = _status(run_id, superlink, LS_TIMEOUT_SECONDS)
    if status == "finished:completed":
        return 0
    print(f"dpledger flwr-run: run {run_id} {status or 'status unknown'}{f' ({details})' if details else ''}: "
          f"exit {EXIT_FAILED}", file=sys.stderr)
    return EXIT_FAILED
