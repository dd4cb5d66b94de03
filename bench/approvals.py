"""Approval throughput and latency of dpledger over real HTTP, against ledger history and pair reuse.

One run measures, for SQLite (a temp file; uvicorn workers 1 and 2) and PostgreSQL (a fresh `public`
schema; workers 2 and 4; skipped when 127.0.0.1:5432 does not answer):

* approvals/s and p50/p99 latency with 16 concurrent closed-loop clients (one keep-alive connection
  each; a minimal asyncio HTTP/1.1 client, ~0.3 ms CPU per request, or `--client httpx` for
  httpx.AsyncClient, ~2.5 ms) against a server in a child process (`dpledger.harness.running_server`),
  plus the p50 with one client (no queueing);
* for a silo with a history of 10 charges and one with `--history` charges (default 100,000),
  the ratio of their p50s; the two are measured interleaved (small, big, big, small, `--rounds`
  times) so that drift of the machine or of the database falls on both alike;
* for a repeated (q, σ) pair (the curve cache hits) and for a fresh σ on every request (dp-accounting
  computes a curve);
* the time dp-accounting takes to replay a 1,000-charge history from scratch, beside our p50;
* CPU per request of the load generator, the server tree and PostgreSQL (psutil), and the cores
  that other processes used meanwhile (the machine may be shared).

The big history is seeded in bulk (bench/_seeding.py: the ledger's own functions, 2,000 charges a
transaction), which gives the state a loop of `charges.reserve` would give (checked at start on a
small history, `_seeding.check`; the seeded chain is verified with `audit.verify` at the end).

    python bench/approvals.py              # full run (~9 min on 2 cores)
    python bench/approvals.py --quick      # smoke test (~1 min): history 2000, SQLite w1, PostgreSQL w2
    python bench/approvals.py --cpu-compare /path/to/older/site   # server CPU per approval, before/after
    python bench/approvals.py --floor      # server CPU per approval beside the stack's floor app (bench/_floor.py)

Prints a table, then one JSON line with every figure. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _seeding
import httpx
import numpy as np
from sqlalchemy import create_engine, text

from dpledger.harness import free_port, running_server
from dpledger.service.accounting import rdp
from dpledger.service.ledger import audit, silos
from dpledger.service.ledger.sequencer import GATHER_MAX_S
from dpledger.service.store.db import Database, make_engine, migrate
from dpledger.service.store.models import (
    Silo,
)
from dpledger.wire.mechanisms import DpSgd

from _harness import (
    CpuSnapshot,
    RawClient,
    balance_connections,
    cpu_snapshot,
    find_server_root,
    grown,
    json_safe,
    log,
    reset_postgres,
    wait_until_settled,
)

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

# Every silo: the largest budget the API accepts, so nothing is refused while timing.
EPSILON, DELTA, DATASET_SIZE, BATCH_SIZE = 1e4, 1e-5, 60_000, 256
REPEATED_SIGMA = 1.1  # the pair of every "repeated" request and of every small silo's history
SEED_SIGMAS = (1.0, 1.1, 1.2, 1.3)  # the big history cycles over these pairs
SMALL_HISTORY = 10
# After a burst or a paced run, the sequencer's last batch (it gathers leaves up to GATHER_MAX_S
# after a ring), counted with the approvals that rang it.
SETTLE_S = GATHER_MAX_S + 0.5


# --------------------------------------------------------------------------------------------------
# The big silo's history (seeded in bulk, bench/_seeding.py)


def seed_mechanism(i: int) -> DpSgd:
    return DpSgd(batch_size=BATCH_SIZE, noise_multiplier=SEED_SIGMAS[i % len(SEED_SIGMAS)], steps=1)


# --------------------------------------------------------------------------------------------------
# Load generation


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    elapsed: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    postgres_cpu: float = 0.0
    busy: float = 0.0
    machine: float = 0.0

    def add_cpu(self, before: CpuSnapshot, after: CpuSnapshot) -> None:
        self.client_cpu += after.client - before.client
        self.server_cpu += grown(before.server, after.server)
        self.postgres_cpu += grown(before.postgres, after.postgres)
        self.busy += after.busy - before.busy
        self.machine += after.total - before.total


class Sigmas:
    """A fresh σ for every "new pair" request of the run: every one is a cache miss."""

    def __init__(self) -> None:
        self.k = 0

    def next(self) -> float:
        self.k += 1
        return 2.0 + self.k * 1e-6


def charge_body(key: str, sigma: float) -> bytes:
    return json.dumps({
        "mechanism": {"type": "dpsgd", "batch_size": BATCH_SIZE, "noise_multiplier": sigma, "steps": 1},
        "idempotency_key": key,
    }).encode()


class HttpxClient:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        return (await self.client.post(path, content=body, headers=headers)).status_code


async def fire(
    client: RawClient | HttpxClient, silo: dict[str, Any], n: int, concurrency: int, *, sigma_of: Callable[[], float],
    tag: str, tally: Tally | None, server_root: int | None,
) -> None:
    """`n` approvals for `silo` by `concurrency` closed-loop callers; adds what it saw to `tally`."""
    path = f"/v1/silos/{silo['id']}/charges"
    headers = {"authorization": f"Bearer {silo['api_key']}", "content-type": "application/json"}
    next_index = 0
    latencies: list[float] = []
    statuses: Counter = Counter()

    async def one_caller() -> None:
        nonlocal next_index
        while next_index < n:
            i = next_index
            next_index += 1
            body = charge_body(f"{tag}-{i}", sigma_of())
            t0 = time.perf_counter()
            try:
                statuses[await client.post(path, body, headers)] += 1
            except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError) as error:
                statuses[type(error).__name__] += 1
            latencies.append(time.perf_counter() - t0)

    before = cpu_snapshot(server_root)
    t0 = time.perf_counter()
    await asyncio.gather(*(one_caller() for _ in range(min(concurrency, n))))
    elapsed = time.perf_counter() - t0
    after = cpu_snapshot(server_root)
    if tally is not None:
        tally.latencies += latencies
        tally.statuses += statuses
        tally.elapsed += elapsed
        tally.add_cpu(before, after)


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else math.nan  # linear interpolation between ranks


def summarize(t: Tally) -> dict[str, Any]:
    n = len(t.latencies)
    ok = t.statuses.get(201, 0)
    return {
        "requests": n,
        "ok_201": ok,
        "non_201": n - ok,
        "non_201_by_status": {str(k): v for k, v in t.statuses.items() if k != 201},
        "approvals_per_s": ok / t.elapsed if t.elapsed else math.nan,
        "p50_ms": percentile(t.latencies, 50) * 1e3,
        "p99_ms": percentile(t.latencies, 99) * 1e3,
        "mean_ms": statistics.fmean(t.latencies) * 1e3 if n else math.nan,
        "client_cpu_ms_per_req": t.client_cpu / n * 1e3 if n else math.nan,
        "server_cpu_ms_per_req": t.server_cpu / n * 1e3 if n else math.nan,
        "postgres_cpu_ms_per_req": t.postgres_cpu / n * 1e3 if n else math.nan,
        "machine_cpu_util": t.busy / t.machine if t.machine else math.nan,
        # cores kept busy meanwhile by processes that are neither the bench, the server nor postgres
        "other_cpu_cores": max(0.0, t.busy - t.client_cpu - t.server_cpu - t.postgres_cpu) / t.elapsed if t.elapsed else math.nan,
    }


# --------------------------------------------------------------------------------------------------
# One server configuration: fresh small silos, the shared big silo, both pair modes


async def create_small_silo(admin: httpx.AsyncClient, loader: RawClient | HttpxClient, name: str) -> dict[str, Any]:
    r = await admin.post(
        "/v1/silos", headers={"authorization": f"Bearer {ADMIN_KEY}"},
        json={"name": name, "epsilon": EPSILON, "delta": DELTA, "dataset_size": DATASET_SIZE},
    )
    r.raise_for_status()
    silo = r.json()
    await fire(loader, silo, SMALL_HISTORY, 1, sigma_of=lambda: REPEATED_SIGMA, tag="history", tally=None, server_root=None)
    return silo


async def run_config(url: str, big: dict[str, Any], args: argparse.Namespace, label: str, sigmas: Sigmas,
                     history_count: Callable[[int], int]) -> dict[str, Any]:
    server_root = find_server_root()
    settle = wait_until_settled(server_root, args.workers_now)
    log(f"{label}: server settled {settle:.1f} s after its first answer")
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120.0) as admin:
        loader = HttpxClient(admin) if args.client == "httpx" else RawClient(url, args.concurrency)
        for mode in ("repeated", "new"):
            small = await create_small_silo(admin, loader, f"{label}-{mode}-small")
            spread = None
            if isinstance(loader, RawClient) and args.balance:
                spread = await balance_connections(loader, server_root, args.workers_now)
                log(f"{label} {mode}: keep-alive connections per worker {spread}")
            sigma_of = (lambda: REPEATED_SIGMA) if mode == "repeated" else sigmas.next
            n = args.requests if mode == "repeated" else args.new_requests
            # Warm-up: every connection, and the repeated pair's curve in every worker's cache.
            warm = args.warm if mode == "repeated" else 4
            for silo in (small, big):
                await fire(loader, silo, warm, args.concurrency, sigma_of=sigma_of, tag=f"{label}-{mode}-warm",
                           tally=None, server_root=None)
            histories = {"small": history_count(small["id"]), "big": history_count(big["id"])}
            tallies = {"small": Tally(), "big": Tally()}
            serial = {"small": Tally(), "big": Tally()}
            # Interleaved small, big, big, small (`rounds` times): drift of the machine or of the
            # database falls on both silos alike.
            order = [("small", "big", "big", "small")[k % 4] for k in range(4 * args.rounds)]
            for part, which in enumerate(order):
                silo = small if which == "small" else big
                await fire(loader, silo, n // (2 * args.rounds), args.concurrency, sigma_of=sigma_of,
                           tag=f"{label}-{mode}-c{args.concurrency}-{part}", tally=tallies[which], server_root=server_root)
            if mode == "repeated" and args.serial_requests:
                # Unloaded latency: one client at a time, same interleaving.
                for part, which in enumerate(order):
                    silo = small if which == "small" else big
                    await fire(loader, silo, args.serial_requests // (2 * args.rounds), 1, sigma_of=sigma_of,
                               tag=f"{label}-{mode}-c1-{part}", tally=serial[which], server_root=server_root)
            cell: dict[str, Any] = {}
            for which in ("small", "big"):
                row = summarize(tallies[which])
                row["history_at_start"] = histories[which]
                if serial[which].latencies:
                    row["p50_ms_unloaded"] = percentile(serial[which].latencies, 50) * 1e3
                cell[which] = row
            cell["p50_ratio_big_over_small"] = cell["big"]["p50_ms"] / cell["small"]["p50_ms"]
            if "p50_ms_unloaded" in cell["big"]:
                cell["p50_unloaded_ratio_big_over_small"] = cell["big"]["p50_ms_unloaded"] / cell["small"]["p50_ms_unloaded"]
            cell["connections_per_worker"] = spread
            results[mode] = cell
            log(f"{label} {mode}: small {cell['small']['approvals_per_s']:.0f}/s p50 {cell['small']['p50_ms']:.1f} ms; "
                f"big {cell['big']['approvals_per_s']:.0f}/s p50 {cell['big']['p50_ms']:.1f} ms; "
                f"ratio {cell['p50_ratio_big_over_small']:.2f}")
        if isinstance(loader, RawClient):
            await loader.aclose()
    return results


# --------------------------------------------------------------------------------------------------
# One database: migrate, seed the big silo, run each worker count, verify the big chain


def postgres_answers(url: str) -> str | None:
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            version = connection.execute(text("SHOW server_version")).scalar()
        engine.dispose()
        return str(version)
    except Exception as error:
        log(f"PostgreSQL at {url}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        return None


def bench_database(kind: str, url: str, workers_list: list[int], args: argparse.Namespace, sigmas: Sigmas) -> dict[str, Any]:
    migrate(url)
    engine = make_engine(url)
    db = Database(engine)
    big_silo, big_key = silos.register(db, name=f"{kind}-big", epsilon=EPSILON, delta=DELTA, dataset_size=DATASET_SIZE)
    log(f"{kind}: seeding {args.history} charges into silo {big_silo.id} …")
    t0 = time.perf_counter()
    _seeding.seed(db, big_silo.id, args.history, mechanism=seed_mechanism)
    seed_s = time.perf_counter() - t0
    if kind == "sqlite":
        with engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    else:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.exec_driver_sql("VACUUM ANALYZE")
    log(f"{kind}: seeded {args.history} charges in {seed_s:.1f} s ({seed_s / max(args.history, 1) * 1e6:.0f} µs/charge)")

    def history_count(silo_id: int) -> int:
        with db.read() as session:
            return int(session.get(Silo, silo_id).chain_seq) - 1  # minus the genesis entry; = reservations

    out: dict[str, Any] = {"seed_charges": args.history, "seed_s": seed_s, "runs": {}}
    big = {"id": big_silo.id, "api_key": big_key}
    for workers in workers_list:
        label = f"{kind}-w{workers}"
        log(f"{label}: starting uvicorn with {workers} worker(s)")
        args.workers_now = workers
        t0 = time.perf_counter()
        with running_server(database_url=url, admin_key=ADMIN_KEY, workers=workers) as server_url:
            log(f"{label}: first answer after {time.perf_counter() - t0:.1f} s")
            out["runs"][str(workers)] = asyncio.run(run_config(server_url, big, args, label, sigmas, history_count))
    if args.verify:
        t0 = time.perf_counter()
        with db.read() as session:
            report = audit.verify(session, [big_silo.id])
        out["verify_big_silo"] = {"ok": report.ok, "entries": report.entries, "seconds": time.perf_counter() - t0,
                                  "problems": report.problems[:3]}
        log(f"{kind}: audit.verify of the big silo: ok={report.ok}, {report.entries} entries, "
            f"{out['verify_big_silo']['seconds']:.1f} s")
    if kind == "sqlite":
        out["db_file_mb"] = Path(url.removeprefix("sqlite:///")).stat().st_size / 2**20
    engine.dispose()
    return out


# --------------------------------------------------------------------------------------------------
# Server CPU per approval, this tree beside another install (`--cpu-compare SITE`), interleaved


# Either tree's migrations: the store's, or the ledger's before the store had a package of its own.
_MIGRATE = """import sys
try:
    from dpledger.service.store.db import migrate
except ImportError:
    from dpledger.service.ledger.db import migrate
migrate(sys.argv[1])"""


FLOOR = "floor"  # the stack's floor app (bench/_floor.py) in place of a dpledger install
BENCH = str(Path(__file__).resolve().parent)


def _start_server(site: str | None, url: str, cwd: str) -> tuple[subprocess.Popen[bytes], str]:
    """A one-worker server of the install at `site` (PYTHONPATH; None: this tree; FLOOR: the floor app),
    run from `cwd` (outside the repository, whose `dpledger/` would shadow `site`), on a database it
    migrated itself (the floor makes its one table)."""
    env = {**os.environ, "DATABASE_URL": url, "DPLEDGER_ADMIN_KEY": ADMIN_KEY, "FLOOR_DATABASE_URL": url}
    port = free_port()
    if site == FLOOR:
        env["PYTHONPATH"] = BENCH
        command = [sys.executable, "-m", "uvicorn", "--factory", "_floor:make_app", "--host", "127.0.0.1", "--port",
                   str(port), "--workers", "1", "--log-level", "warning"]
    else:
        if site is not None:
            env["PYTHONPATH"] = site
        subprocess.run([sys.executable, "-c", _MIGRATE, url], env=env, cwd=cwd, check=True)
        command = [sys.executable, "-m", "dpledger.service.serving", "--host", "127.0.0.1", "--port", str(port),
                   "--workers", "1", "--log-level", "warning"]
    process = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True)
    server_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server of {site or 'this tree'} did not answer on {server_url}")
        try:
            if httpx.get(f"{server_url}/healthz", timeout=1.0).status_code == 200:
                return process, server_url
        except httpx.TransportError:
            time.sleep(0.1)


async def _cpu_cell(server_url: str, pid: int, n: int, concurrency: int, *, floor: bool = False,
                    paced: tuple[float, float] | None = None) -> tuple[Tally, dict[str, float]]:
    """`n` approvals by `concurrency` clients, after a warm-up; with `paced` (rate a second, seconds):
    then the server's CPU at rest and at that paced rate, each per second and per approval."""
    async with httpx.AsyncClient(base_url=server_url, timeout=60.0) as admin:
        loader = RawClient(server_url, concurrency)
        silo = {"id": 1, "api_key": "floor"} if floor else await create_small_silo(admin, loader, "cpu")
        await fire(loader, silo, 4 * concurrency, concurrency, sigma_of=lambda: REPEATED_SIGMA, tag="warm", tally=None,
                   server_root=None)
        tally = Tally()
        await fire(loader, silo, n, concurrency, sigma_of=lambda: REPEATED_SIGMA, tag="cpu", tally=tally, server_root=pid)
        await loader.aclose()
        extra: dict[str, float] = {}
        if paced is not None:
            rate, seconds = paced
            await asyncio.sleep(SETTLE_S)  # the burst's tail (a sequencer's batch) settles first
            before = cpu_snapshot(pid)
            await asyncio.sleep(seconds)
            idle = grown(before.server, cpu_snapshot(pid).server) / seconds
            extra["idle_ms_per_s"] = idle * 1e3
            one, paced_tally = RawClient(server_url, 1), Tally()  # apart: the full-rate row divides by its own count
            count, started = int(rate * seconds), time.perf_counter()
            before = cpu_snapshot(pid)
            for i in range(count):
                await fire(one, silo, 1, 1, sigma_of=lambda: REPEATED_SIGMA, tag=f"paced{i}", tally=paced_tally,
                           server_root=None)
                await asyncio.sleep(max(0.0, started + (i + 1) / rate - time.perf_counter()))
            took = time.perf_counter() - started
            await asyncio.sleep(SETTLE_S)  # the last approvals' batch is theirs: counted, less the rest's rate
            spent = grown(before.server, cpu_snapshot(pid).server) - idle * SETTLE_S
            await one.aclose()
            extra["paced_ms_per_s"] = spent / took * 1e3
            extra["paced_ms_per_approval"] = spent / count * 1e3
            extra["paced_non_201"] = count - paced_tally.statuses.get(201, 0)
    return tally, extra


def cpu_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Server CPU per approval (repeated pair, one worker, a fresh silo) of this tree and of the
    install at `args.cpu_compare`, alternating (before, after) `args.rounds` times on each database,
    each cell on a fresh database: the medians compare code, not the machine's drift."""
    trees: dict[str, str | None] = {"before": FLOOR if args.floor else args.cpu_compare, "after": None}
    paced = (args.paced_rate, args.paced_seconds) if args.floor or args.paced else None
    databases = ["sqlite"] + ([] if args.no_postgres or postgres_answers(args.pg_url) is None else ["postgres"])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dpledger-cpu-") as tmp:
        for kind in databases:
            cells: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for k in range(args.rounds):
                for name in ("before", "after") if k % 2 == 0 else ("after", "before"):
                    if kind == "sqlite":
                        url = f"sqlite:///{tmp}/{kind}-{name}-{k}.db"
                    else:
                        url = args.pg_url
                        reset_postgres(url)
                    process, server_url = _start_server(trees[name], url, tmp)
                    try:
                        tally, extra = asyncio.run(_cpu_cell(server_url, process.pid, args.requests, args.concurrency,
                                                             floor=trees[name] == FLOOR, paced=paced))
                        row = {**summarize(tally), **extra}
                    finally:
                        os.killpg(process.pid, signal.SIGTERM)
                        process.wait()
                    cells[name].append(row)
                    log(f"cpu {kind} {name} round {k}: server {row['server_cpu_ms_per_req']:.2f} ms/approval, "
                        f"postgres {row['postgres_cpu_ms_per_req']:.2f}, {row['approvals_per_s']:.0f}/s, "
                        f"non-201 {row['non_201']}")
            out[kind] = {
                name: {
                    "server_cpu_ms_median": statistics.median(r["server_cpu_ms_per_req"] for r in rows),
                    "postgres_cpu_ms_median": statistics.median(r["postgres_cpu_ms_per_req"] for r in rows),
                    "approvals_per_s_median": statistics.median(r["approvals_per_s"] for r in rows),
                    "server_cpu_ms": [r["server_cpu_ms_per_req"] for r in rows],
                    "non_201": sum(r["non_201"] + r.get("paced_non_201", 0) for r in rows),
                    **{f"{key}_median": statistics.median(r[key] for r in rows)
                       for key in ("idle_ms_per_s", "paced_ms_per_s", "paced_ms_per_approval") if key in rows[0]},
                }
                for name, rows in cells.items()
            }
    return out


def print_cpu_compare(results: dict[str, Any], args: argparse.Namespace) -> None:
    before = "the stack's floor (bench/_floor.py)" if args.floor else args.cpu_compare
    print(f"server CPU per approval, repeated (q, σ) pair, 1 uvicorn worker, {args.concurrency} clients, "
          f"{args.requests} approvals x {args.rounds} rounds per tree and database, alternating; "
          f"before = {before}, after = this tree; {os.cpu_count()} cores")
    print(f"{'db':8} {'tree':7} {'srv ms median':>13} {'pg ms median':>12} {'appr/s':>7}  server ms per round")
    for kind, cell in results.items():
        for name in ("before", "after"):
            r = cell[name]
            rounds = " ".join(f"{v:.2f}" for v in r["server_cpu_ms"])
            print(f"{kind:8} {name:7} {r['server_cpu_ms_median']:>13.2f} {r['postgres_cpu_ms_median']:>12.2f} "
                  f"{r['approvals_per_s_median']:>7.0f}  {rounds}")
    if not (args.floor or args.paced):
        return
    ratio = "this tree ÷ the floor" if args.floor else "after ÷ before"
    print(f"\n{ratio} (medians; at rest: ms of server CPU a second; paced: {args.paced_rate:g} approvals/s "
          f"for {args.paced_seconds:g} s, the server's CPU over that time and its last batch, per approval)")
    for kind, cell in results.items():
        floor, ours = cell["before"], cell["after"]
        print(f"{kind:8} full rate {ours['server_cpu_ms_median'] / floor['server_cpu_ms_median']:5.2f}x   "
              f"paced {ours['paced_ms_per_approval_median']:.2f} / {floor['paced_ms_per_approval_median']:.2f} ms = "
              f"{ours['paced_ms_per_approval_median'] / floor['paced_ms_per_approval_median']:5.2f}x   "
              f"at rest {ours['idle_ms_per_s_median']:.1f} / {floor['idle_ms_per_s_median']:.1f} ms/s")


# --------------------------------------------------------------------------------------------------
# The baseline: a service without a running sum replays the history through dp-accounting


def replay_baseline(n: int) -> dict[str, Any]:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    accountant = rdp_lib.RdpAccountant(list(rdp.ORDERS))
    q0 = BATCH_SIZE / DATASET_SIZE
    t0 = time.perf_counter()
    for i in range(n):  # distinct (q, σ) per event: nothing for dp-accounting to fold together
        accountant.compose(dp_event.PoissonSampledDpEvent(
            q0 * (1 + i * 1e-5), dp_event.GaussianDpEvent(1.0 + i * 1e-4)))
    eps = accountant.get_epsilon(DELTA)
    seconds = time.perf_counter() - t0
    return {"events": n, "seconds": seconds, "ms_per_event": seconds / n * 1e3, "epsilon": eps,
            "seconds_for_1000_est": seconds / n * 1000}


# --------------------------------------------------------------------------------------------------
# Output


def print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    header = (
        f"{'db':8} {'wk':>2} {'pairs':8} {'history':>8} {'n':>5} {'non201':>6} {'appr/s':>7} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'p50@1':>6} {'ratio':>6} {'rat@1':>6} {'cli ms':>6} {'srv ms':>6} {'pg ms':>6} "
        f"{'cpu%':>5} {'other':>5} {'conns':>7}"
    )
    print(
        f"approvals over HTTP, {args.concurrency} concurrent clients ({args.client} client); history = the silo's charges at "
        f"the start; ratio = p50 big / p50 small history; p50@1 = p50 with one client (rat@1 its ratio); "
        f"cli/srv/pg ms = CPU ms per request "
        f"in the load generator / uvicorn / postgres; cpu% = machine busy (of {os.cpu_count()} cores); "
        f"other = cores used meanwhile by processes outside this bench; conns = keep-alive connections per worker"
    )
    print(header)
    print("-" * len(header))
    for kind in ("sqlite", "postgres"):
        db = results["databases"].get(kind)
        if db is None:
            continue
        if "skipped" in db:
            print(f"{kind:8} skipped: {db['skipped']}")
            continue
        for workers, run in db["runs"].items():
            for mode in ("repeated", "new"):
                cell = run[mode]
                for which in ("small", "big"):
                    r = cell[which]
                    ratio = f"{cell['p50_ratio_big_over_small']:.2f}" if which == "big" else ""
                    ratio1 = (
                        f"{cell['p50_unloaded_ratio_big_over_small']:.2f}"
                        if which == "big" and "p50_unloaded_ratio_big_over_small" in cell
                        else ""
                    )
                    unloaded = f"{r['p50_ms_unloaded']:.1f}" if "p50_ms_unloaded" in r else ""
                    conns = "/".join(map(str, cell.get("connections_per_worker") or [])) or "-"
                    print(
                        f"{kind:8} {workers:>2} {mode:8} {r['history_at_start']:>8} {r['requests']:>5} {r['non_201']:>6} "
                        f"{r['approvals_per_s']:>7.1f} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} "
                        f"{unloaded:>6} {ratio:>6} {ratio1:>6} "
                        f"{r['client_cpu_ms_per_req']:>6.2f} {r['server_cpu_ms_per_req']:>6.2f} "
                        f"{r['postgres_cpu_ms_per_req']:>6.2f} {100 * r['machine_cpu_util']:>5.0f} "
                        f"{r['other_cpu_cores']:>5.2f} {conns:>7}"
                    )
    print()
    for kind in ("sqlite", "postgres"):
        db = results["databases"].get(kind)
        if db and "seed_s" in db:
            extra = f", file {db['db_file_mb']:.0f} MiB" if "db_file_mb" in db else ""
            v = db.get("verify_big_silo")
            ver = f"; audit.verify of that chain: ok={v['ok']} ({v['entries']} entries, {v['seconds']:.1f} s)" if v else ""
            print(f"seeding {kind}: {db['seed_charges']} charges in {db['seed_s']:.1f} s{extra}{ver}")
    rb = results["replay"]
    est = "" if rb["events"] == 1000 else f" (measured on {rb['events']}, scaled to 1,000)"
    print(f"replay baseline: dp-accounting composes 1,000 distinct Poisson-sampled Gaussians and reads ε in "
          f"{rb['seconds_for_1000_est']:.1f} s{est} ({rb['ms_per_event']:.1f} ms/event)")
    for line in results["aims"]["lines"]:
        print(line)


def judge(results: dict[str, Any]) -> dict[str, Any]:
    lines = []
    ratios, sqlite_rates, replay_vs = [], {}, []
    replay_s = results["replay"]["seconds_for_1000_est"]
    for kind, db in results["databases"].items():
        for workers, run in db.get("runs", {}).items():
            for mode in ("repeated", "new"):
                cell = run[mode]
                ratios.append((f"{kind} w{workers} {mode}", cell["p50_ratio_big_over_small"]))
                if mode == "repeated":
                    p50 = cell["big"]["p50_ms"]
                    replay_vs.append((f"{kind} w{workers}", p50, replay_s * 1e3 / p50))
                    if kind == "sqlite":
                        sqlite_rates[workers] = cell["small"]["approvals_per_s"], cell["big"]["approvals_per_s"]
    worst = max(ratios, key=lambda r: r[1]) if ratios else ("", math.nan)
    ok_ratio = all(r <= 1.2 for _, r in ratios)
    lines.append(f"aim p50(big history) <= 1.2 x p50(10): {'MET' if ok_ratio else 'MISSED'} "
                 f"(worst {worst[1]:.2f} at {worst[0]}; " + ", ".join(f"{n} {r:.2f}" for n, r in ratios) + ")")
    best = max((min(v), w) for w, v in sqlite_rates.items()) if sqlite_rates else (math.nan, "")
    lines.append(f"aim >= 300 approvals/s on SQLite, repeated pair: {'MET' if best[0] >= 300 else 'MISSED'} "
                 f"(best {best[0]:.0f}/s with {best[1]} worker(s); " +
                 ", ".join(f"w{w}: {a:.0f}/s (10) {b:.0f}/s (big)" for w, (a, b) in sqlite_rates.items()) + ")")
    for name, p50, ratio in replay_vs:
        lines.append(f"replay of 1,000 charges vs our p50 at the big history ({name}, repeated, 16 clients): "
                     f"{replay_s:.1f} s / {p50:.1f} ms = {ratio:,.0f}x")
    return {"lines": lines, "p50_ratio_ok": ok_ratio, "sqlite_300_ok": best[0] >= 300}


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: history 2000, few requests, SQLite w1 + PostgreSQL w2 only, replay 20"
    )
    parser.add_argument("--history", type=int, help="charges in the big silo (default 100000; quick 2000)")
    parser.add_argument("--requests", type=int, help="timed repeated-pair requests per silo and config (default 2000)")
    parser.add_argument("--new-requests", type=int, help="timed new-pair requests per silo and config (default 160)")
    parser.add_argument("--serial-requests", type=int, help="unloaded (1 client) requests per silo (default 120)")
    parser.add_argument("--replay", type=int, help="events in the dp-accounting replay (default 1000; quick 50)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, help="small/big/big/small passes per measurement (default 5; quick 1)")
    parser.add_argument("--no-balance", dest="balance", action="store_false",
                        help="keep the kernel's spread of keep-alive connections over workers (mostly onto one)")
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw",
                        help="load generator: raw asyncio HTTP/1.1 (default, light) or httpx.AsyncClient")
    parser.add_argument("--sqlite-workers", help="uvicorn worker counts on SQLite (default 1,2; quick 1)")
    parser.add_argument("--pg-workers", help="uvicorn worker counts on PostgreSQL (default 2,4; quick 2)")
    parser.add_argument("--pg-url", default=os.environ.get("DPLEDGER_BENCH_POSTGRES_URL", DEFAULT_PG_URL))
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip audit.verify of the big chain")
    parser.add_argument("--cpu-compare", metavar="SITE",
                        help="only server CPU per approval: the install at SITE (a PYTHONPATH) beside this tree, "
                             "alternating (--requests per cell, default 1000; --rounds, default 5)")
    parser.add_argument("--floor", action="store_true",
                        help="only server CPU per approval: the stack's floor app (bench/_floor.py) beside this tree, "
                             "at full rate, paced and at rest, alternating (--rounds, default 5)")
    parser.add_argument("--paced", action="store_true",
                        help="--cpu-compare: the paced and at-rest figures too, as --floor prints them")
    parser.add_argument("--paced-rate", type=float, default=5.0,
                        help="--floor, --paced: approvals a second, paced (default 5)")
    parser.add_argument("--paced-seconds", type=float, default=12.0,
                        help="--floor, --paced: seconds paced, and at rest (default 12)")
    args = parser.parse_args(argv)
    if args.cpu_compare or args.floor:
        args.requests = args.requests or 1000
        args.rounds = args.rounds or 5
        results = {"config": dict(vars(args)), "cpu": cpu_compare(args)}
        print_cpu_compare(results["cpu"], args)
        print(json.dumps(json_safe(results), default=str, allow_nan=False))
        return 0
    quick = args.quick
    args.history = args.history if args.history is not None else (2000 if quick else 100_000)
    args.requests = args.requests if args.requests is not None else (200 if quick else 2000)
    args.new_requests = args.new_requests if args.new_requests is not None else (16 if quick else 160)
    args.serial_requests = args.serial_requests if args.serial_requests is not None else (20 if quick else 120)
    args.replay = args.replay if args.replay is not None else (20 if quick else 1000)
    args.rounds = args.rounds if args.rounds is not None else (1 if quick else 5)
    args.warm = (2 if quick else 4) * args.concurrency
    args.sqlite_workers = args.sqlite_workers or ("1" if quick else "1,2")
    args.pg_workers = args.pg_workers or ("2" if quick else "2,4")

    started = time.perf_counter()
    results: dict[str, Any] = {"config": dict(vars(args)), "databases": {}}
    results["config"]["cpu_count"] = os.cpu_count()
    log(_seeding.check())
    results["seed_check"] = "ok"
    sigmas = Sigmas()

    with tempfile.TemporaryDirectory(prefix="dpledger-bench-") as tmp:
        url = f"sqlite:///{tmp}/ledger.db"
        results["databases"]["sqlite"] = bench_database(
            "sqlite", url, [int(w) for w in args.sqlite_workers.split(",") if w], args, sigmas)

    version = None if args.no_postgres else postgres_answers(args.pg_url)
    if version is None:
        print("skipped: no PostgreSQL", flush=True)
        results["databases"]["postgres"] = {"skipped": "no PostgreSQL"}
    else:
        log(f"PostgreSQL {version}: dropping and recreating schema public")
        reset_postgres(args.pg_url)
        results["databases"]["postgres"] = bench_database(
            "postgres", args.pg_url, [int(w) for w in args.pg_workers.split(",") if w], args, sigmas)
        results["databases"]["postgres"]["server_version"] = version

    log(f"replaying {args.replay} distinct events through dp-accounting …")
    results["replay"] = replay_baseline(args.replay)
    results["aims"] = judge(results)
    results["total_s"] = time.perf_counter() - started
    print_table(results, args)
    print(f"total {results['total_s']:.0f} s")
    print(json.dumps(json_safe(results), default=str, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
