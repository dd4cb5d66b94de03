"""`dpledger wait` (a script's way to find its server up before the next step) and `dpledger data
digits` (example silo files in the format a silo's Flower ClientApp reads)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from dpledger.cli import main
from dpledger.harness import free_port
from dpledger.trainer.data.digits_files import write_digits_silo_files


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_wait_returns_once_the_url_answers_2xx_or_the_port_accepts(http_server: int) -> None:
    assert main(["wait", f"http://127.0.0.1:{http_server}/healthz", "--timeout", "5"]) == 0
    assert main(["wait", f"127.0.0.1:{http_server}", "--timeout", "5"]) == 0


def test_wait_fails_in_one_line_when_nothing_answers_in_time(http_server: int, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    started = time.monotonic()
    assert main(["wait", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.startswith(f"dpledger wait: 127.0.0.1:{port} did not answer within 0.5 s (last: ") and err.count("\n") == 1
    # A server that answers, but not 2xx, is not ready.
    assert main(["wait", f"http://127.0.0.1:{http_server}/not-ready", "--timeout", "0.5"]) == 1
    assert "(last: HTTP 503)" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["no-port", "ftp://127.0.0.1:21/", "127.0.0.1:http"])
def test_wait_refuses_a_target_it_cannot_read(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["wait", target, "--timeout", "0.1"]) == 2
    assert capsys.readouterr().err.startswith("dpledger wait: ")


def test_wait_sees_a_server_that_starts_while_it_waits() -> None:
    port = free_port()
    waiter = subprocess.Popen([sys.executable, "-m", "dpledger.cli", "wait", f"127.0.0.1:{port}", "--timeout", "60"])
    try:
        time.sleep(1.0)
        assert waiter.poll() is None  # still waiting
        with socket.create_server(("127.0.0.1", port)):
            assert waiter.wait(timeout=30) == 0
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()


def test_data_digits_writes_disjoint_silo_files_the_client_app_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "digits", "--silos", "3", "--train", "50", "--test", "10", "--out", str(tmp_path)]) == 0
    paths = [tmp_path / f"silo-{k}.npz" for k in (1, 2, 3)]
    assert capsys.readouterr().out.split() == [str(p) for p in paths]
    seen: set[bytes] = set()
    for path in paths:
        with np.load(path, allow_pickle=False) as archive:
            assert sorted(archive.files) == ["x", "x_test", "y", "y_test"]
            x, y, x_test, y_test = archive["x"], archive["y"], archive["x_test"], archive["y_test"]
        assert (x.shape, y.shape, x_test.shape, y_test.shape) == ((50, 64), (50,), (10, 64), (10,))
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert 0.0 <= x.min() and x.max() <= 1.0 and 0 <= y.min() and y.max() <= 9
        rows = {row.tobytes() for row in np.concatenate([x, x_test])}
        assert not rows & seen  # no image in two silos (compared by pixels)
        seen |= rows
    # The format dpledger.flower.local.load_silo_file reads (flwr and torch installed).
    local = pytest.importorskip("dpledger.flower.local")
    assert local.load_silo_file(paths[0]).size == 50
    # Again, unchanged seed: the same files; an existing file is kept unless --force.
    assert main(["data", "digits", "--silos", "1", "--train", "50", "--test", "10", "--out", str(tmp_path)]) == 2
    assert "silo-1.npz exists; pass overwrite (--force) to replace it." in capsys.readouterr().err
    again = write_digits_silo_files(tmp_path / "again", silos=3, train=50, test=10)
    for first, second in zip(paths, again, strict=True):
        with np.load(first) as a, np.load(second) as b:
            assert all(np.array_equal(a[key], b[key]) for key in a.files)


def test_data_digits_refuses_more_records_than_the_digits_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "digits", "--silos", "4", "--train", "400", "--test", "100", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "dpledger data digits: the digits hold 1797 images; 4 silos × (400 + 100) need 2000.\n"
    )
    assert list(tmp_path.iterdir()) == []
