"""`dpledger flwr-run` against a stand-in `flwr` (a script that prints what Flower 1.41's `flwr run
--stream` and `flwr ls --format json` print): its exit code follows the run's status as `flwr ls`
reports it, and a `flwr ls` that never ends (a starved machine) gives one line, not a traceback."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dpledger.flower import flwr_run

FAKE = """import json, os, sys, time
from pathlib import Path
if sys.argv[1] == "run":
    print("Successfully started run 4711", flush=True)
    print("the ServerApp's log", flush=True)
    sys.exit(0)
calls = Path(os.environ["FAKE_CALLS"])
calls.write_text(calls.read_text() + " ".join(sys.argv[1:]) + "\\n")
answers = os.environ["FAKE_LS"].split(",")
answer = answers[min(calls.read_text().count("\\n"), len(answers)) - 1]
if answer == "hang":
    time.sleep(60)
print(json.dumps({"success": True, "runs": [{"run-id": 4711, "status": answer, "status-details": ""}]}))
"""


@pytest.fixture()
def fake_flwr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "flwr"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    monkeypatch.setattr(flwr_run, "_flwr", lambda: str(script))
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    return calls


def test_a_completed_run_exits_0_after_asking_the_same_superlink(fake_flwr: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_LS", "running,finished:completed")
    assert flwr_run.main(["app", "local", "--run-config", "rounds=2"]) == 0
    assert fake_flwr.read_text().splitlines() == ["ls local --run-id 4711 --format json"] * 2
    assert "the ServerApp's log" in capsys.readouterr().out


def test_a_failed_run_exits_1_with_one_line_naming_it(fake_flwr: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_LS", "finished:failed")
    assert flwr_run.main(["app", "local"]) == 1
    assert capsys.readouterr().err.strip() == "dpledger flwr-run: run 4711 finished:failed: exit 1"


def test_a_flwr_ls_that_never_ends_is_stopped_and_said_in_one_line(fake_flwr: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_LS", "hang")
    monkeypatch.setattr(flwr_run, "LS_TIMEOUT_SECONDS", 1.0)
    started = time.monotonic()
    assert flwr_run.main(["app", "local"]) == 1
    assert time.monotonic() - started < 30  # the hung `flwr ls` was stopped at its timeout, and not asked again
    assert fake_flwr.read_text().count("\n") == 1
    assert capsys.readouterr().err.strip() == ("dpledger flwr-run: run 4711 status unknown "
                                               "(`flwr ls` did not answer within 1 s): exit 1")

