"""`dpledger flwr-run`: Flower's `flwr run`, ending with the run's outcome as its exit code.

`flwr run --stream` (Flower 1.41) exits 0 whatever became of the run: it streams the logs and never
reads the run's status, so a script that starts a federation cannot tell a ServerApp that failed or
was killed from one that finished. This runs `flwr run APP [SUPERLINK] … --stream` with the
arguments as given, then asks the same SuperLink for the run's status (`flwr ls --run-id`, so it
holds for a remote SuperLink too) and exits 0 for `finished:completed`, 1 for any other end (the
ServerApp raised: nothing trained, a refused resume…; or it was killed, which Flower 1.41 reports
as `finished:failed` too) with one line naming the status, and `flwr run`'s own code when that
failed. A stream that ends while the run still runs (its connection dropped, as on a starved
machine) is followed again (`flwr log RUN_ID --stream`, without the lines already shown), and a
`flwr ls` that does not answer is asked again, up to LS_TRIES times. Stopped itself (SIGINT,
SIGTERM), it stops `flwr` and exits 130; the run goes on at the SuperLink, as after Ctrl-C in
`flwr run`.
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
# One `flwr ls` imports Flower in a new process: seconds on a quiet machine, minutes on a starved core
# (one beside busy processes took over 120 s, and once over 240 s). Past LS_TRIES of these the status
# is "unknown", said in one line.
LS_TIMEOUT_SECONDS = 240.0
LS_TRIES = 3
# A stream that ends while the run is not finished is followed again at most this many times (each
# ends only when the run finishes or its connection drops), a second apart.
FOLLOW_AGAIN = 10
MARKER = "Starting logstream for run_id"


def _flwr() -> str:
    """The `flwr` beside this Python (the environment dpledger runs in), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "flwr")
    return beside if os.access(beside, os.X_OK) else (shutil.which("flwr") or "flwr")


def _status(run_id: int, superlink: Sequence[str], timeout: float) -> tuple[str, str]:
    """(status, details): the run's status as the SuperLink reports it, or ("", why) when it cannot be
    read (`flwr ls` did not end within `timeout`, or said why not)."""
    try:
        listed = subprocess.run([_flwr(), "ls", *superlink, "--run-id", str(run_id), "--format", "json"],
                                capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "", f"`flwr ls` did not answer within {timeout:g} s"
    except OSError as error:
        return "", f"`flwr ls` did not start: {error}"
    try:
        runs = json.loads(listed.stdout)["runs"]
        return str(runs[0]["status"]), str(runs[0].get("status-details") or "")
    except (ValueError, KeyError, IndexError, TypeError):
        said = (listed.stdout + listed.stderr).strip().splitlines()
        return "", said[-1] if said else "no answer"


class _Stream:
    """The run's log as shown so far: a stream followed again starts from the run's first line, so
    the lines already shown (after Flower's "Starting logstream" line) are skipped, once each."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.run_id: int | None = None

    def follow(self, command: list[str], again: bool) -> int:
        """Runs `command` (flwr run/log --stream), showing its new lines; returns its exit code."""
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def stop(signum: int, _frame: FrameType | None) -> None:
            process.terminate()
            print(f"dpledger flwr-run: stopped by {signal.Signals(signum).name}; the run goes on at the SuperLink "
                  "(`flwr stop RUN_ID` ends it)", file=sys.stderr)
            sys.exit(EXIT_STOPPED)

        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        in_log, skipped = False, 0
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if not in_log and MARKER in line:
                    in_log = True
                    if again:  # `flwr log`'s own marker: shown once already
                        continue
                elif again:
                    if not in_log:  # `flwr log`'s own lines before the run's log
                        continue
                    if skipped < len(self.shown) and line == self.shown[skipped]:
                        skipped += 1
                        continue
                    again = False  # a line not shown before: everything from here on is new
                sys.stdout.write(line)
                sys.stdout.flush()
                if in_log and MARKER not in line:
                    self.shown.append(line)
                found = STARTED.search(line)
                if found and self.run_id is None:
                    self.run_id = int(found.group(1))
            return process.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _outcome(stream: _Stream, run_id: int, superlink: Sequence[str]) -> tuple[str, str]:
    """(status, details) once the run is finished, or the last answer (or why there was none) when it
    cannot be learnt: a run the SuperLink says still runs is followed again (its stream dropped), a
    `flwr ls` without a status (it did not end, or said why not) asked again a second later."""
    unanswered = followed = 0
    while True:
        status, details = _status(run_id, superlink, LS_TIMEOUT_SECONDS)
        if status.startswith("finished"):
            return status, details
        if status:
            if followed >= FOLLOW_AGAIN:
                return status, details
            followed += 1
            time.sleep(1.0)
            stream.follow([_flwr(), "log", str(run_id), *superlink, "--stream"], again=True)
            continue
        unanswered += 1
        if unanswered >= LS_TRIES:
            return status, details
        time.sleep(1.0)


def main(argv: Sequence[str]) -> int:
    """`argv` as `flwr run` takes it: APP, then SUPERLINK if given, then options."""
    positional = [a for a in argv[:2] if not a.startswith("-")]
    superlink = positional[1:2]
    stream = _Stream()
    # In this process's group: whatever stops the group (Ctrl-C, `kill -- -PGID`) stops flwr too.
    code = stream.follow([_flwr(), "run", *argv, *([] if "--stream" in argv else ["--stream"])], again=False)
    if code != 0 or stream.run_id is None:
        return code or EXIT_FAILED
    status, details = _outcome(stream, stream.run_id, superlink)
    if status == "finished:completed":
        return 0
    print(f"dpledger flwr-run: run {stream.run_id} {status or 'status unknown'}{f' ({details})' if details else ''}: "
          f"exit {EXIT_FAILED}", file=sys.stderr)
    return EXIT_FAILED
