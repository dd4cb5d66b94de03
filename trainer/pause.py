"""A test's hold on `dpledger train` at one point of a round, so that a real process can be
interrupted exactly there (tests/trainer/test_resume.py).

With `DPLEDGER_TEST_PAUSE="POINT:ROUND:FILE"` the worker, on reaching POINT of round ROUND (counted
from 1, as `train` prints rounds), creates FILE and sleeps until a signal stops it (at most
`HOLD_S` seconds, then it goes on). Unset, as in every real run, nothing is held.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from dpledger.trainer.loop import Pause

ENV = "DPLEDGER_TEST_PAUSE"
POINTS = ("before-reserve", "after-reserve", "mid-training", "after-commit")
HOLD_S = 60.0


def from_env(environ: Mapping[str, str]) -> Pause | None:
    raw = environ.get(ENV)
    if not raw:
        return None
    point, round_text, path = raw.split(":", 2)
    if point not in POINTS:
        raise ValueError(f"{ENV}: the point must be one of {', '.join(POINTS)}. Found {point!r}.")
    at, ready = int(round_text) - 1, Path(path)

    def hold(reached: str, round_index: int) -> None:
        if (reached, round_index) != (point, at):
            return
        ready.write_text(f"{point} {round_index + 1}\n")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            time.sleep(0.05)

    return hold
