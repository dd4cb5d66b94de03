"""A real federation on 127.0.0.1 for the tests: `dpledger serve`, `flower-superlink --insecure`,
one `flower-supernode` per silo (its own data file and key file), and `flwr run`, each a process
in its own session on a free port, all killed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from sklearn.datasets import load_digits

from dpledger.harness import free_port
from dpledger.trainer.client import LedgerClient
from dpledger.wire.enums import Role

BIN = Path(sys.executable).parent
APP_DIR = Path(__file__).resolve().parents[2] / "dpledger" / "flower" / "app"
DELTA = 1e-5


def write_silo_files(folder: Path, *, silos: int, train: int, test: int, seed: int = 0) -> list[Path]:
    """Disjoint slices of scikit-learn's digits, one .npz per silo, pixels scaled to [0, 1]."""
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    paths = []
    for k in range(silos):
        rows = order[k * (train + test) : (k + 1) * (train + test)]
        x = (digits.data[rows] / 16.0).astype(np.float32)
        y = digits.target[rows].astype(np.int64)
        path = folder / f"silo-{k}.npz"
        np.savez(path, x=x[:train], y=y[:train], x_test=x[train:], y_test=y[train:])
        paths.append(path)
    return paths


@dataclass
class Silo:
    silo_id: int
    epsilon: float
    key_file: Path
    data_file: Path
    noise_multiplier: float
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None


@dataclass
class Federation:
    folder: Path
    ledger_url: str
    admin_key: str
    superlink_port: int
    coordinator_key_file: Path
    silos: list[Silo] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        # Flower starts its own helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name.
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "PATH": path, "FLWR_HOME": str(self.folder / "flwr-home"), "PYTHONUNBUFFERED": "1"}

    def start(self, command: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            process = subprocess.Popen(command, env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def start_supernode(self, silo: Silo) -> None:
        node_config = (
            f"ledger-url='{self.ledger_url}' silo-id={silo.silo_id} key-file='{silo.key_file}' "
            f"data-path='{silo.data_file}' noise-multiplier={silo.noise_multiplier}"
        )
        silo.log = self.folder / f"supernode-{silo.silo_id}.log"
        silo.process = self.start(
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.superlink_port}",
             "--port", str(free_port()), "--node-config", node_config],
            silo.log,
        )

    @staticmethod
    def run_command(config: dict[str, object]) -> list[str]:
        """`flwr run` of the app with run-config overrides, its logs streamed."""
        overrides = " ".join(f"{k}={_toml(v)}" for k, v in config.items())
        return [str(BIN / "flwr"), "run", str(APP_DIR), "local", "--stream", "--run-config", overrides]

    def run(self, *, timeout: float, **config: object) -> subprocess.CompletedProcess[str]:
        """Runs the app and waits for the run to finish."""
        return subprocess.run(self.run_command(config), env=self.env(), capture_output=True, text=True,
                              timeout=timeout, check=False)

    def start_run(self, log: Path, **config: object) -> subprocess.Popen[bytes]:
        """Starts the app's run and returns at once (its output goes to `log`)."""
        return self.start(self.run_command(config), log)

    def ledger(self) -> LedgerClient:
        return LedgerClient(self.ledger_url, self.admin_key)


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing answered on {url} within {timeout} s")


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Flower detaches some helpers into sessions of their own, so
    killing a process group is not enough)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the process, its session and every descendant (a SuperNode's ClientApp processes,
    the SuperLink's SuperExec and ServerApp)."""
    for pid in _descendants(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@contextmanager
def federation(folder: Path, *, budgets: list[float], noise_multiplier: float, train: int, test: int) -> Iterator[Federation]:
    admin_key = "admin-" + os.urandom(16).hex()
    ledger_port, superlink_port = free_port(), free_port()
    fed = Federation(folder=folder, ledger_url=f"http://127.0.0.1:{ledger_port}", admin_key=admin_key,
                     superlink_port=superlink_port, coordinator_key_file=folder / "coordinator.key")
    (folder / "flwr-home").mkdir()
    (folder / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{superlink_port}"\ninsecure = true\n'
    )
    try:
        serve = fed.start(
            ["env", f"DATABASE_URL=sqlite:///{folder / 'ledger.db'}", f"DPLEDGER_ADMIN_KEY={admin_key}",
             str(BIN / "dpledger"), "serve", "--port", str(ledger_port)],
            folder / "ledger.log",
        )
        _wait_http(f"{fed.ledger_url}/healthz", serve, 60)
        data = write_silo_files(folder, silos=len(budgets), train=train, test=test)
        with fed.ledger() as admin:
            fed.coordinator_key_file.write_text(admin.create_key(role=Role.coordinator).api_key)
            for k, (epsilon, path) in enumerate(zip(budgets, data, strict=True)):
                created = admin.create_silo(name=f"site-{k}", epsilon=epsilon, delta=DELTA, dataset_size=train)
                key_file = folder / f"silo-{created.id}.key"
                key_file.write_text(created.api_key)
                key_file.chmod(0o600)
                fed.silos.append(Silo(created.id, epsilon, key_file, path, noise_multiplier))
        link = fed.start(
            [str(BIN / "flower-superlink"), "--insecure", "--port", str(superlink_port),
             "--disable-runtime-dependency-installation"],
            folder / "superlink.log",
        )
        _wait_http(f"http://127.0.0.1:{superlink_port}/", link, 60)
        for silo in fed.silos:
            fed.start_supernode(silo)
        yield fed
    finally:
        for process in fed.processes:
            kill(process)
