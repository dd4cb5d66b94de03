"""Federation.wait_run: a run is waited for while its federation's logs grow, and killed with a
failure showing those logs once they have all been silent for the stall window."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flower.federation import Federation


def _federation(folder: Path) -> Federation:
    return Federation(folder=folder, ledger_url="", admin_key="", superlink_port=0, coordinator_key_file=folder / "key")


def _start(fed: Federation, code: str) -> subprocess.Popen[bytes]:
    return fed.start([sys.executable, "-c", code], fed.folder / "flwr-run.log")


def test_a_run_whose_logs_keep_growing_is_waited_for_past_the_stall_window(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    # A line every 0.3 s for 4 s, with a stall window of 1.5 s: slow, not stuck.
    runner = _start(fed, "import time\nfor i in range(13):\n    print(i, flush=True); time.sleep(0.3)\nraise SystemExit(3)")
    assert fed.wait_run(runner, stall=1.5, limit=60) == 3
    assert (tmp_path / "flwr-run.log").read_text().split() == [str(i) for i in range(13)]


def test_a_run_whose_logs_all_fall_silent_is_killed_and_fails_showing_them(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    (tmp_path / "superlink.log").write_text("the superlink's last line\n")
    runner = _start(fed, "import time\nprint('started', flush=True)\ntime.sleep(600)")
    began = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        fed.wait_run(runner, stall=3, limit=60)
    assert time.monotonic() - began < 30
    assert runner.returncode is not None
    said = str(failed.value)
    assert "no log grew for 3 s" in said and "the superlink's last line" in said and "started" in said


def test_a_run_past_its_limit_fails_although_its_logs_grow(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    runner = _start(fed, "import time\nwhile True:\n    print('busy', flush=True); time.sleep(0.2)")
    with pytest.raises(pytest.fail.Exception, match="still running after 3 s"):
        fed.wait_run(runner, stall=60, limit=3)
    assert runner.returncode is not None
