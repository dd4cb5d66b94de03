"""What the benches share: a progress log, CPU accounting through psutil (this process, the server's
process tree, PostgreSQL, the whole machine, and the load of everything else on a shared machine),
finding the uvicorn processes `dpledger.harness.running_server` started, and a light HTTP/1.1 client.

Benches run as scripts (`python bench/x.py`), so this module is imported by its plain name.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psutil
from sqlalchemy import Engine, create_engine, text

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"# {time.perf_counter() - _T0:6.1f}s {message}", file=sys.stderr, flush=True)


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float as None (for `json.dumps(..., allow_nan=False)`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# CPU accounting


def cpu_seconds(process: psutil.Process) -> float | None:
    """The process's CPU seconds (user + system, every thread it ever ran) in nanoseconds: the kernel's
    process-wide CPU clock (clock_getcpuclockid's: ((~pid) << 3) | 2 on Linux). The 10 ms ticks of
    /proc/<pid>/stat read a process at rest 12 or 20 s long as 1.5 or 2.5 ms/s for the same 1.7, and
    the floor's 60 paced approvals as -13 ms (ticks and per-thread schedstat mixed: a thread's ticks
    move by ±10 ms between two readings). Ticks only where the clock cannot be read (not Linux)."""
    try:
        return time.clock_gettime(((~process.pid) << 3) | 2)
    except (OSError, OverflowError):
        pass
    try:
        times = process.cpu_times()
    except psutil.Error:  # exited meanwhile, or not ours to read
        return None
    return float(times.user + times.system)


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of `root` and each live descendant, per pid."""
    try:
        parent = psutil.Process(root)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return {}
    return {p.pid: s for p in processes if (s := cpu_seconds(p)) is not None}


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, over all cores."""
    times = psutil.cpu_times()
    total = sum(times)
    return total - times.idle - getattr(times, "iowait", 0.0), total


@dataclass
class CpuSnapshot:
    client: float  # this process
    server: dict[int, float]  # per pid: a process that exits between two snapshots is lost, never negative
    postgres: dict[int, float]
    busy: float
    total: float


def cpu_snapshot(server_root: int | None) -> CpuSnapshot:
    server = tree_cpu(server_root) if server_root is not None else {}
    postgres = {
        p.pid: s
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith("postgres") and (s := cpu_seconds(p)) is not None
    }
    busy, total = machine_busy()
    return CpuSnapshot(time.process_time(), server, postgres, busy, total)


def grown(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


class OtherLoad:
    """Cores used by processes outside this bench and its children while the block ran."""

    def __enter__(self) -> OtherLoad:
        self._t, (self._busy, _), self._tree = time.perf_counter(), machine_busy(), tree_cpu(psutil.Process().pid)
        self.cores = math.nan
        return self

    def __exit__(self, *_: object) -> None:
        elapsed = time.perf_counter() - self._t
        other = (machine_busy()[0] - self._busy) - grown(self._tree, tree_cpu(psutil.Process().pid))
        self.cores = max(0.0, other) / elapsed if elapsed > 0 else math.nan


# --------------------------------------------------------------------------------------------------
# The server's processes


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def find_server_root() -> int | None:
    """The pid of the `ServerProcess` (python -m dpledger.service.serving) this process started."""
    for child in psutil.Process().children():
        if "dpledger.service.serving" in _cmdline(child):
            return int(child.pid)
    return None


def worker_pids(root: int | None) -> list[int]:
    """uvicorn's worker processes under `root` (multiprocessing's spawn_main), or [root] with one worker."""
    if root is None:
        return []
    try:
        children = psutil.Process(root).children()
    except psutil.Error:
        return []
    return sorted(c.pid for c in children if "spawn_main" in _cmdline(c)) or [root]


def wait_until_settled(root: int | None, workers: int, timeout: float = 120.0) -> float:
    """`running_server` returns once one worker answers; the others may still be importing (or be
    respawning: a worker can die at start-up). Wait until `workers` live workers exist and the
    server tree burns < 5 % of a core over half a second."""
    t0 = time.perf_counter()
    if root is None:
        return 0.0
    while time.perf_counter() - t0 < timeout:
        before = tree_cpu(root)
        time.sleep(0.5)
        live = len(worker_pids(root)) if workers > 1 else 1
        if live >= workers and grown(before, tree_cpu(root)) < 0.025:
            break
    return time.perf_counter() - t0


def connection_owners(server_port: int) -> dict[int, int]:
    """Client port -> pid of the server process that accepted that connection on 127.0.0.1."""
    return {
        c.raddr.port: c.pid
        for c in psutil.net_connections(kind="tcp4")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == server_port and c.raddr and c.pid
    }


# --------------------------------------------------------------------------------------------------
# A light HTTP/1.1 client


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams (~10x less CPU per request than
    httpx.AsyncClient, which matters when the load generator shares 2 cores with the server).
    One connection per concurrent caller, at most `limit` of them."""

    def __init__(self, url: str, limit: int) -> None:
        hostport = url.removeprefix("http://").rstrip("/")
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)
        self.limit = limit
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        return await self.request("POST", path, body, headers)

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> int:
        head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n{head}content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        while True:
            reader, writer, reused = await self._connection()
            writer.write(request)
            try:
                status_and_headers = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                self._drop(writer)
                if reused and not getattr(error, "partial", b""):
                    continue  # the server had closed the idle connection: nothing was received, send again
                raise
            break
        try:
            status, length, keep = _parse_head(status_and_headers)
            if length:
                await reader.readexactly(length)
        except BaseException:
            self._drop(writer)
            raise
        if keep:
            self.idle.append((reader, writer))
        else:
            self._drop(writer)
        return status

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        while self.idle:
            reader, writer = self.idle.pop()
            if not (reader.at_eof() or writer.is_closing()):  # uvicorn closes connections idle > 5 s
                return reader, writer, True
            self._drop(writer)
        if self.opened >= self.limit:
            raise RuntimeError("more concurrent callers than connections")
        reader, writer = await asyncio.open_connection(self.host, self.port)  # asyncio sets TCP_NODELAY
        self.opened += 1
        return reader, writer, False

    def _drop(self, writer: asyncio.StreamWriter) -> None:
        writer.close()
        self.opened -= 1

    def client_ports(self) -> list[int]:
        return [writer.get_extra_info("sockname")[1] for _, writer in self.idle]

    async def close_port(self, port: int) -> None:
        for k, (_, writer) in enumerate(self.idle):
            if writer.get_extra_info("sockname")[1] == port:
                del self.idle[k]
                self._drop(writer)
                return

    async def fill(self) -> None:
        """Opens connections up to the limit (each answers a GET /healthz, so a worker accepted it)."""
        kept, self.idle = self.idle, []  # so that every caller below opens a new connection
        try:
            await asyncio.gather(*(self.request("GET", "/healthz") for _ in range(self.limit - self.opened)))
        finally:
            self.idle = kept + self.idle

    async def aclose(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


def _parse_head(raw: bytes) -> tuple[int, int, bool]:
    """(status, content-length, keep-alive) of a response head."""
    lines = raw.decode("latin-1").split("\r\n")
    status, length, keep = int(lines[0].split(" ", 2)[1]), 0, True
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "connection" and value.strip().lower() == "close":
            keep = False
    return status, length, keep


async def balance_connections(loader: RawClient, root: int | None, workers: int, tries: int = 400) -> list[int]:
    """With several workers on one listening socket, the kernel hands most keep-alive connections
    to one worker (15 of 16 seen here), which makes `--workers 2` serve like 1. Close connections
    of the busiest worker and reconnect until each worker holds its share. Returns connections per
    worker."""
    pids = worker_pids(root)
    target = math.ceil(loader.limit / max(len(pids), 1))
    counts: Counter[int] = Counter()
    for _ in range(tries):
        await loader.fill()
        owners = connection_owners(loader.port)
        stale = [p for p in loader.client_ports() if p not in owners]  # closed by the server meanwhile
        for port in stale:
            await loader.close_port(port)
        if stale:
            continue
        mine = {p: owners[p] for p in loader.client_ports()}
        counts = Counter({pid: 0 for pid in pids})
        counts.update(mine.values())
        if workers <= 1 or max(counts.values()) <= target:
            break
        busiest = max(counts, key=lambda pid: counts[pid])
        victim = next(p for p, pid in mine.items() if pid == busiest)
        await loader.close_port(victim)
        await asyncio.sleep(0.005)
    return sorted(counts.values(), reverse=True)


def postgres_answers(url: str) -> bool:
    """Whether a PostgreSQL server answers at `url` within 3 s (the benches skip it otherwise)."""
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:
        return False


def reset_postgres(url: str) -> None:
    """Schema `public` dropped and created again: a bench starts from an empty database."""
    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()


def wait_sequenced(engine: Engine, timeout: float = 60.0) -> None:
    """Until the log's sequencer moved every pending leaf (a bulk seed leaves all of its leaves pending)."""
    deadline = time.monotonic() + timeout
    with engine.connect() as connection:
        while connection.execute(text("SELECT count(*) FROM log_pending")).scalar_one():
            connection.rollback()
            if time.monotonic() > deadline:
                raise RuntimeError("the log's sequencer left leaves pending")
            time.sleep(0.1)
