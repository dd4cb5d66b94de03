"""A real federation on 127.0.0.1 for the tests: `dpledger serve`, `flower-superlink --insecure`,
one `flower-supernode` per silo (its own data file and key file; it starts its own `flower-superexec`),
and `flwr run`, each on a free port, all killed at the end.

Flower 1.41 starts a fresh `flwr-clientapp` process for every message (no warm ClientApp exists for
the subprocess executor). The SuperExec's 1 s task poll (`FLWR_SUPEREXEC_TASK_POLL_INTERVAL`) is kept:
a shorter one costs more CPU at rest than it saves (SUPEREXEC_POLL_SECONDS). The SuperNode's 3 s idle
poll and `Grid.send_and_receive`'s 3 s poll are hard-coded in Flower: bench/flower_rounds.py measures
what they cost a round."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from dp_accounting import dp_event as de

from dpledger.flower.gate import SILO_LINE
from dpledger.flower.settings import SIMULATION_NODES_ENV
from dpledger.harness import free_port
from dpledger.trainer.data.digits_files import write_digits_silo_files
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import Role
from tests import gate_oracle
from tests.block_processes import log_tails
from tests.faults.proxy import Proxy

BIN = Path(sys.executable).parent
APP_DIR = Path(__file__).resolve().parents[2] / "dpledger" / "flower" / "app"
DELTA = 1e-5
# How often a SuperExec asks its SuperNode (or the SuperLink) for a task to start, in seconds: Flower's
# default. A 50 ms poll saved each message up to a second, but burned ~24% of a core per SuperLink and
# SuperNode pair between messages, the CPU the ClientApps' start-ups need: test_federation.py ran in
# 302 s with it and 271 s without, and the README's block 312 s against 214 s on a core shared with 10
# busy processes.
SUPEREXEC_POLL_SECONDS = 1.0
# "subprocess" (Flower's default, as the README runs it): the SuperNode starts its own SuperExec, which
# inherits the poll interval above; "process": we start each SuperNode's `flower-superexec` ourselves,
# in the SuperNode's process group (bench/flower_rounds.py --isolation compares them: the same speed).
ISOLATION = "subprocess"
# A run on a starved machine is slow, not stuck: it is waited for while any log of its federation grows
# (a ClientApp start-up writes nothing, and took up to 161 s on a busy CI host; three of them follow each
# other in every run), and fails once every log has been silent this long, or past the caller's limit.
RUN_STALL_SECONDS = 360.0
RUN_LIMIT_SECONDS = 900.0
# Chooses a silo's σ with the silo's own ledger client and id (e.g. `calibrate_silo`), as a site would.
NoiseChoice = Callable[[LedgerClient, int], float]


def expected_epsilon(silo: Any, *, rounds: int, steps: int, sampling_rate: float, noise_multiplier: float,
                     pmtl_rounds: int = 0, server_noise: float = 1.0, delta: float = DELTA) -> float:
    """The oracle of every ε assertion over Flower (one place): the ε the silo's published filter reads
    (tests/gate_oracle.py, dp-accounting's curves and conversion) of `rounds` rounds of `steps`
    Poisson-sampled Gaussian steps (q = `sampling_rate`, σ = `noise_multiplier`), then `pmtl_rounds`
    PMTL rounds, each the Gaussian at `server_noise` / 2."""
    curve = gate_oracle.dpsgd_curve([(sampling_rate, noise_multiplier, steps * rounds)])
    if pmtl_rounds:
        curve = curve + gate_oracle.event_curve(de.SelfComposedDpEvent(de.GaussianDpEvent(server_noise / 2), pmtl_rounds))
    return gate_oracle.proven_epsilon(gate_oracle.filter_pairs(silo), curve, delta=delta)


def budget_for_rounds(rounds: int, *, steps: int, sampling_rate: float, noise_multiplier: float, dataset_size: int) -> float:
    """A budget that admits exactly `rounds` rounds of DP-SGD (and not one more) on a fresh silo."""
    def run(n: int) -> list[tuple[float, float, int]]:
        return [(sampling_rate, noise_multiplier, steps * n)]

    return gate_oracle.probe_budget(run(rounds), run(rounds + 1), dataset_size=dataset_size, delta=DELTA)


def write_silo_files(folder: Path, *, silos: int, train: int, test: int, seed: int = 0) -> list[Path]:
    """Disjoint slices of scikit-learn's digits, one .npz per silo (silo-0.npz …): `dpledger data digits`."""
    return write_digits_silo_files(folder, silos=silos, train=train, test=test, seed=seed, first=0)


@dataclass
class Silo:
    silo_id: int
    epsilon: float
    key_file: Path
    data_file: Path
    noise_multiplier: float
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    ledger_url: str | None = None  # where its SuperNode reaches the ledger, where not the federation's (a proxy)


@dataclass
class Federation:
    folder: Path
    ledger_url: str
    admin_key: str
    superlink_port: int
    coordinator_key_file: Path
    silos: list[Silo] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # Simulation: the SuperLink's `--federation-config` for `flwr run` (virtual nodes, Ray's CPUs).
    simulation: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    isolation: str = ISOLATION

    def env(self) -> dict[str, str]:
        # Flower starts its own helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name.
        path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "PATH": path, "FLWR_HOME": str(self.folder / "flwr-home"), "PYTHONUNBUFFERED": "1",
                # The caller's own setting wins (bench/flower_rounds.py measures Flower's default of 1 s).
                "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL",
                                                                    str(SUPEREXEC_POLL_SECONDS)),
                **self.extra_env}

    def node_config(self, silo: Silo) -> dict[str, object]:
        """A silo's own settings: a SuperNode's `--node-config`, or its entry of the simulation's file."""
        return {"ledger-url": silo.ledger_url or self.ledger_url, "silo-id": silo.silo_id, "key-file": str(silo.key_file),
                "data-path": str(silo.data_file), "noise-multiplier": silo.noise_multiplier}

    def start(self, command: list[str], log: Path, *, group: int | None = None) -> subprocess.Popen[bytes]:
        """Starts `command` in a session of its own; or, for a SuperNode and its SuperExec, in process
        group `group` of this session (0: a new group; a process may only join a group of its own session)."""
        with log.open("wb") as out:
            if group is None:
                process = subprocess.Popen(command, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            else:
                process = subprocess.Popen(command, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                           process_group=group)
        self.processes.append(process)
        return process

    def start_supernode(self, silo: Silo) -> None:
        node_config = " ".join(f"{k}={_toml(v)}" for k, v in self.node_config(silo).items())
        silo.log = self.folder / f"supernode-{silo.silo_id}.log"
        runtime_port = free_port()  # the SuperNode's Runtime API, which its SuperExec and ClientApps call
        silo.process = self.start(
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.superlink_port}",
             "--isolation", self.isolation, "--port", str(runtime_port), "--node-config", node_config],
            silo.log, group=0,
        )
        if self.isolation == "process":
            # The site's SuperExec: in the SuperNode's process group, so `kill(silo.process)` takes it and
            # the ClientApps it started (their group too) down with the SuperNode, as when a site dies;
            # `--parent-pid` makes it exit by itself should the SuperNode die alone.
            self.start(
                [str(BIN / "flower-superexec"), "--insecure", "--runtime-api-address", f"127.0.0.1:{runtime_port}",
                 "--parent-pid", str(silo.process.pid)],
                self.folder / f"superexec-{silo.silo_id}.log", group=silo.process.pid,
            )

    def run_command(self, config: dict[str, object]) -> list[str]:
        """`flwr run` of the app with run-config overrides, its logs streamed, through `dpledger flwr-run`
        (whose exit code is the run's outcome)."""
        overrides = " ".join(f"{k}={_toml(v)}" for k, v in config.items())
        command = [str(BIN / "dpledger"), "flwr-run", str(APP_DIR), "local", "--stream", "--run-config", overrides]
        return command + (["--federation-config", self.simulation] if self.simulation is not None else [])

    def run(self, *, limit: float = RUN_LIMIT_SECONDS, **config: object) -> subprocess.CompletedProcess[str]:
        """Runs the app and waits for the run to finish (`wait_run`); its output as subprocess.run's."""
        command = self.run_command(config)
        number = sum(1 for _ in self.folder.glob("flwr-run-*.out.log"))
        out, err = self.folder / f"flwr-run-{number}.out.log", self.folder / f"flwr-run-{number}.err.log"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(command, env=self.env(), stdout=stdout, stderr=stderr, start_new_session=True)
        self.processes.append(process)
        code = self.wait_run(process, limit=limit)
        return subprocess.CompletedProcess(command, code, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def wait_run(self, process: subprocess.Popen[bytes], *, limit: float = RUN_LIMIT_SECONDS,
                 stall: float = RUN_STALL_SECONDS) -> int:
        """The exit code of a run started here (in a session of its own), waited for while any log in
        the folder grows; past `stall` seconds of silence from all of them, or `limit` seconds in all,
        its session is killed and the test fails, showing the end of every log."""
        started = changed = time.monotonic()
        seen = self._log_sizes()
        while True:
            try:
                return process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            now, sizes = time.monotonic(), self._log_sizes()
            if sizes != seen:
                seen, changed = sizes, now
            if now - changed > stall or now - started > limit:
                why = (f"no log grew for {stall:.0f} s" if now - changed > stall else f"still running after {limit:.0f} s")
                kill(process)
                process.wait()
                pytest.fail(f"the run {why}:{log_tails(self.folder, tuple(sorted(self._log_sizes())), lines=20)}")

    def _log_sizes(self) -> dict[str, int]:
        return {path.name: path.stat().st_size for path in self.folder.glob("*.log")}

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


def wait_http(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
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


def descendants(pid: int) -> list[int]:
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
    """SIGKILL to the process, its process group and every descendant (a SuperNode's SuperExec and
    ClientApp processes, the SuperLink's SuperExec and ServerApp)."""
    for pid in descendants(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Its group (a SuperNode's holds its SuperExec and their ClientApps), then the process itself,
    # which leads no group when it was started into a SuperNode's.
    for send in (os.killpg, os.kill):
        try:
            send(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(number: int, _: object) -> None:
    raise SystemExit(128 + number)  # as the shell reports a process a signal ended


@contextmanager
def stopped_with_its_starter() -> Iterator[None]:
    """SIGTERM or SIGHUP to the process that starts a federation (a test's or a bench's timeout,
    `kill`) raises SystemExit in it, so that its `finally` kills every process it started (Python's
    default for SIGTERM ends the process at once, its `finally` never run, the federation left
    running: 86 orphaned `flwr-clientapp` processes were once found). SIGINT raises
    KeyboardInterrupt already. Once the `finally` is killing, further signals are ignored."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    previous = {number: signal.signal(number, _exit_on_signal) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for number in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(number, signal.SIG_IGN)


@contextmanager
def federation(folder: Path, *, budgets: list[float], noise_multiplier: float | NoiseChoice, train: int,
               test: int, simulation: bool = False, isolation: str = ISOLATION,
               proxy: Proxy | None = None, proxied: tuple[int, ...] = ()) -> Iterator[Federation]:
    with stopped_with_its_starter():
        yield from _federation(folder, budgets=budgets, noise_multiplier=noise_multiplier, train=train, test=test,
                               simulation=simulation, isolation=isolation, proxy=proxy, proxied=proxied)


def _federation(folder: Path, *, budgets: list[float], noise_multiplier: float | NoiseChoice, train: int,
                test: int, simulation: bool, isolation: str, proxy: Proxy | None,
                proxied: tuple[int, ...]) -> Iterator[Federation]:
    """`noise_multiplier`: every silo's σ, or a function each silo calls with its own key.
    `proxy`, `proxied`: the silos at these positions reach the ledger through `proxy` (not yet
    listening: it is pointed at the ledger here and started), whose rules a test sets.
    `simulation`: no SuperNodes; the SuperLink runs Flower's simulation engine (Ray) with one virtual
    node per silo, whose settings come from the file named by DPLEDGER_SIMULATION_NODES.
    `isolation`: the SuperNodes' `--isolation` ("process": a `flower-superexec` of ours beside each)."""
    if isolation not in ("process", "subprocess"):
        raise ValueError(f"isolation must be 'process' or 'subprocess'. Found {isolation!r}.")
    admin_key = "admin-" + os.urandom(16).hex()
    ledger_port, superlink_port = free_port(), free_port()
    fed = Federation(folder=folder, ledger_url=f"http://127.0.0.1:{ledger_port}", admin_key=admin_key,
                     superlink_port=superlink_port, coordinator_key_file=folder / "coordinator.key", isolation=isolation)
    (folder / "flwr-home").mkdir()
    (folder / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{superlink_port}"\ninsecure = true\n'
    )
    stack = ExitStack()
    try:
        serve = fed.start(
            ["env", f"DATABASE_URL=sqlite:///{folder / 'ledger.db'}", f"DPLEDGER_ADMIN_KEY={admin_key}",
             str(BIN / "dpledger"), "serve", "--port", str(ledger_port)],
            folder / "ledger.log",
        )
        wait_http(f"{fed.ledger_url}/healthz", serve, 60)
        if proxy is not None:
            proxy.upstream_port = ledger_port
            stack.enter_context(proxy)
        data = write_silo_files(folder, silos=len(budgets), train=train, test=test)
        with fed.ledger() as admin:
            fed.coordinator_key_file.write_text(admin.create_key(role=Role.coordinator).api_key)
            for k, (epsilon, path) in enumerate(zip(budgets, data, strict=True)):
                created = admin.create_silo(name=f"site-{k}", epsilon=epsilon, delta=DELTA, dataset_size=train)
                key_file = folder / f"silo-{created.id}.key"
                key_file.write_text(created.api_key)
                key_file.chmod(0o600)
                if callable(noise_multiplier):
                    with LedgerClient(fed.ledger_url, created.api_key) as own:
                        sigma = noise_multiplier(own, created.id)
                else:
                    sigma = noise_multiplier
                fed.silos.append(Silo(created.id, epsilon, key_file, path, sigma,
                                      ledger_url=proxy.url if proxy is not None and k in proxied else None))
        if simulation:
            nodes = folder / "simulation-nodes.json"
            nodes.write_text(json.dumps([fed.node_config(silo) for silo in fed.silos]))
            fed.extra_env[SIMULATION_NODES_ENV] = str(nodes)
            # Ray on the cores there are: one virtual node's ClientApp per CPU at a time.
            cpus = os.cpu_count() or 1
            fed.simulation = f"num_supernodes={len(fed.silos)} init_args_num_cpus={cpus} client_resources_num_cpus=1"
        link = fed.start(
            [str(BIN / "flower-superlink"), "--insecure", "--port", str(superlink_port),
             "--disable-runtime-dependency-installation", *(["--simulation"] if simulation else [])],
            folder / "superlink.log",
        )
        wait_http(f"http://127.0.0.1:{superlink_port}/", link, 60)
        if not simulation:
            for silo in fed.silos:
                fed.start_supernode(silo)
        yield fed
    finally:
        sigint = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        _ignore_stop_signals()  # a second signal must not cut the killing short
        for process in fed.processes:
            kill(process)
        stack.close()
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)


def access_log(fed: Federation, *, role: str | None = None, at_least: int = 0, timeout: float = 10.0) -> list[dict[str, object]]:
    """The ledger's access-log entries so far (`dpledger serve` logs one JSON object a line; the
    `dpledger.access` ones name the route template, the status and the caller's role and key id),
    of `role` only if given. The server writes a request's line after answering it, so a caller that
    expects `at_least` entries waits up to `timeout` seconds for them to reach the file."""
    deadline = time.monotonic() + timeout
    while True:
        entries = []
        for line in (fed.folder / "ledger.log").read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and entry.get("logger") == "dpledger.access" and role in (None, entry.get("role")):
                entries.append(entry)
        if len(entries) >= at_least or time.monotonic() > deadline:
            return entries
        time.sleep(0.05)


def assert_budget_blind(fed: Federation, text: str, result: dict[str, Any]) -> None:
    """Nothing the ServerApp received or logged holds an ε, a budget, or a silo's spent ε."""
    keys = {key for values in result["reply_records"] for key in values}
    assert keys <= {"status.status", "metrics.train-seconds", "metrics.ledger-seconds", "error-code"}, keys
    statuses = {values.get("status.status") for values in result["reply_records"]} - {None}
    assert statuses <= {"trained", "declined", "replayed", "failed"}
    # Under the simulation engine the silos' ClientApps log into the run's stream too: their lines
    # (the mod's prefix) are each silo's own log, which names its budget; the rest is the coordinator's.
    text = "\n".join(line for line in text.splitlines() if SILO_LINE not in line)
    lowered = text.lower()
    assert "epsilon" not in lowered and "budget" not in lowered and "ε" not in text
    with fed.ledger() as admin:
        secrets = [admin.silo(s.silo_id) for s in fed.silos]
    numbers = set(re.findall(r"\d+\.\d+", text))
    for detail in secrets:
        for value in (detail.epsilon, detail.epsilon_spent, detail.epsilon_committed, detail.epsilon_remaining):
            assert not any(n.startswith(f"{value:.3f}") for n in numbers if round(value, 3) > 0), value
