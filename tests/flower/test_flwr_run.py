"""`dpledger flwr-run` against a stand-in `flwr` (a script that prints what Flower 1.41's `flwr run
--stream`, `flwr log --stream` and `flwr ls --format json` print): its exit code follows the run's
status as `flwr ls` reports it; a stream that ends before the run does is followed again, each
line shown once; a `flwr ls` that never ends (a starved machine) is asked again, then gives one
line, not a traceback."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dpledger.flower import flwr_run

FAKE = """import json, os, sys, time
from pathlib import Path
LOG = ["INFO :      Starting logstream for run_id `4711`", "the ServerApp's log", "[ROUND 1/2]"]
if sys.argv[1] == "run":
    print("Successfully started run 4711", flush=True)
    print("\\n".join(LOG), flush=True)
    sys.exit(0)
calls = Path(os.environ["FAKE_CALLS"])
calls.write_text(calls.read_text() + " ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "log":  # from the run's first line, then what was logged since
    print("INFO :      Starting logstream for run_id `4711`\\n" + "\\n".join(LOG[1:] + ["[ROUND 2/2]"]), flush=True)
    sys.exit(0)
answered = [line for line in calls.read_text().splitlines() if line.startswith("ls")]
answers = os.environ["FAKE_LS"].split(",")
answer = answers[min(len(answered), len(answers)) - 1]
if answer == "hang":
    time.sleep(60)
if answer == "unavailable":
    print("Error: the SuperLink is unavailable")
    sys.exit(1)
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
    monkeypatch.setenv("FAKE_LS", "finished:completed")
    assert flwr_run.main(["app", "local", "--run-config", "rounds=2"]) == 0
    assert fake_flwr.read_text().splitlines() == ["ls local --run-id 4711 --format json"]
    assert "the ServerApp's log" in capsys.readouterr().out


def test_a_stream_that_ends_before_the_run_is_followed_again_showing_each_line_once(
        fake_flwr: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_LS", "running,finished:completed")
    assert flwr_run.main(["app", "local"]) == 0
    assert fake_flwr.read_text().splitlines() == ["ls local --run-id 4711 --format json", "log 4711 local --stream",
                                                  "ls local --run-id 4711 --format json"]
    shown = capsys.readouterr().out.splitlines()
    assert [line for line in shown if "logstream" not in line] == [
        "Successfully started run 4711", "the ServerApp's log", "[ROUND 1/2]", "[ROUND 2/2]"]


def test_a_failed_run_exits_1_with_one_line_naming_it(fake_flwr: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_LS", "finished:failed")
    assert flwr_run.main(["app", "local"]) == 1
    assert capsys.readouterr().err.strip() == "dpledger flwr-run: run 4711 finished:failed: exit 1"


def test_a_flwr_ls_that_does_not_end_is_asked_again(fake_flwr: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LS", "hang,finished:completed")
    monkeypatch.setattr(flwr_run, "LS_TIMEOUT_SECONDS", 1.0)
    assert flwr_run.main(["app", "local"]) == 0
    assert fake_flwr.read_text().splitlines() == ["ls local --run-id 4711 --format json"] * 2


def test_a_superlink_that_does_not_answer_is_asked_again_and_its_log_not_followed(
        fake_flwr: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LS", "unavailable,finished:failed")
    assert flwr_run.main(["app", "local"]) == 1
    assert fake_flwr.read_text().splitlines() == ["ls local --run-id 4711 --format json"] * 2


def test_a_flwr_ls_that_never_ends_is_stopped_and_said_in_one_line(fake_flwr: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_LS", "hang")
    monkeypatch.setattr(flwr_run, "LS_TIMEOUT_SECONDS", 1.0)
    started = time.monotonic()
    assert flwr_run.main(["app", "local"]) == 1
    assert time.monotonic() - started < 30  # each hung `flwr ls` was stopped at its timeout
    assert fake_flwr.read_text().count("\n") == flwr_run.LS_TRIES
    assert capsys.readouterr().err.strip() == ("dpledger flwr-run: run 4711 status unknown "
                                               "(`flwr ls` did not answer within 1 s): exit 1")
