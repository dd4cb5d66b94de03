"""What a server costs while nobody asks it anything: CPU per second of each process of a real
`dpledger serve` (the supervisor and every worker), read in nanoseconds from the kernel's process CPU
clock (_harness.cpu_seconds) over a quiet window after start-up, on SQLite (one worker by default) and on
PostgreSQL (4 workers).

A ledger mostly waits (a federation sends a few approvals a second at most), so what it burns at
rest is paid all day: the aim is ≤ 2 ms of CPU a second per process (docs/benchmarks.md).

    python bench/idle.py                      # SQLite w1, then PostgreSQL w4 if 127.0.0.1:5432 answers
    python bench/idle.py --seconds 20 --sqlite-workers 1,2 --pg-workers 4

Before the quiet window the server approves a few charges (so a leader that sequences, a pool that
holds connections and the caches are all in the state a ledger is in between two requests), then
waits `--settle` seconds. Prints one line per process and database, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import psutil
from sqlalchemy import create_engine, text

from dpledger.harness import free_port

from _harness import cpu_seconds, json_safe, log, postgres_answers, reset_postgres, wait_until_settled

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}


def _tree(root: int) -> list[psutil.Process]:
    parent = psutil.Process(root)
    return [parent, *parent.children(recursive=True)]


def _role(process: psutil.Process, root: int) -> str:
    if process.pid == root:
        return "main"
    try:
        cmdline = " ".join(process.cmdline())
    except psutil.Error:
        return "gone"
    return "worker" if "spawn_main" in cmdline else "child"


def start_serve(url: str, workers: int, folder: str) -> tuple[subprocess.Popen[bytes], str]:
    """`dpledger serve` (the command an operator runs: migrates, then uvicorn) in a session of its own."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "DPLEDGER_ADMIN_KEY": ADMIN_KEY}
    command = [str(Path(sys.executable).with_name("dpledger")), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--workers", str(workers), "--log-format", "text"]
    log_file = open(Path(folder) / f"serve-{port}.log", "wb")  # lives as long as the server
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"dpledger serve exited with {process.returncode}: see {log_file.name}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("dpledger serve did not answer within 120 s")


def warm(base: str, approvals: int) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base, timeout=60) as client:
        silo = client.post("/v1/silos", headers=admin, json={"name": "idle", "epsilon": 1e4, "delta": 1e-5,
                                                             "dataset_size": 1000, "horizon": STEP}).json()
        headers = {"Authorization": f"Bearer {silo['api_key']}"}
        for i in range(approvals):  # new connections land on whichever worker accepts them
            with httpx.Client(base_url=base, timeout=60) as fresh:
                answer = fresh.post(f"/v1/silos/{silo['id']}/charges", headers=headers,
                                    json={"mechanism": STEP, "idempotency_key": f"warm-{i}"})
                answer.raise_for_status()


def sessions_opened(url: str) -> int | None:
    """PostgreSQL: sessions ever opened on the database (pg_stat_database, PostgreSQL 14+)."""
    if not url.startswith("postgresql"):
        return None
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(text(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()")).scalar_one())
    except Exception:
        return None
    finally:
        engine.dispose()


def measure(url: str, workers: int, *, seconds: float, settle: float, approvals: int, folder: str) -> dict[str, Any]:
    process, base = start_serve(url, workers, folder)
    try:
        wait_until_settled(process.pid, workers)  # every worker started, none still importing
        warm(base, approvals)
        time.sleep(settle)
        processes = _tree(process.pid)
        sessions = sessions_opened(url)
        before = {p.pid: cpu_seconds(p) for p in processes}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        after_sessions = sessions_opened(url)
        rows = []
        for p in processes:
            start, end = before.get(p.pid), cpu_seconds(p)
            if start is None or end is None:
                continue
            rows.append({"pid": p.pid, "role": _role(p, process.pid), "ms_per_s": (end - start) / elapsed * 1e3})
        # The sessions this server opened meanwhile, less the first read's own.
        opened = None if sessions is None or after_sessions is None else after_sessions - sessions - 1
        return {"workers": workers, "seconds": elapsed, "processes": rows, "postgres_sessions_opened": opened,
                "max_ms_per_s": max(r["ms_per_s"] for r in rows), "total_ms_per_s": sum(r["ms_per_s"] for r in rows)}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="the quiet window measured (default 20)")
    parser.add_argument("--settle", type=float, default=3.0, help="wait after the warm-up approvals (default 3)")
    parser.add_argument("--approvals", type=int, default=8, help="approvals before the quiet window (default 8)")
    parser.add_argument("--sqlite-workers", default="1")
    parser.add_argument("--pg-workers", default="4")
    parser.add_argument("--pg-url", default=os.environ.get("DPLEDGER_BENCH_POSTGRES_URL", DEFAULT_PG_URL))
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"config": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="dpledger-idle-") as folder:
        cells = [("sqlite", int(w)) for w in args.sqlite_workers.split(",") if w]
        if not args.no_postgres and postgres_answers(args.pg_url):
            cells += [("postgres", int(w)) for w in args.pg_workers.split(",") if w]
        for k, (kind, workers) in enumerate(cells):
            if kind == "sqlite":
                url = f"sqlite:///{folder}/idle-{k}.db"
            else:
                url = args.pg_url
                reset_postgres(url)
            log(f"{kind} w{workers}: serving, {args.approvals} approvals, then {args.seconds:.0f} s of quiet")
            run = {"database": kind, **measure(url, workers, seconds=args.seconds, settle=args.settle,
                                                  approvals=args.approvals, folder=folder)}
            results["runs"].append(run)
            for row in run["processes"]:
                print(f"{kind:8} w{workers} {row['role']:6} pid {row['pid']:>7}: {row['ms_per_s']:6.2f} ms CPU/s")
            print(f"{kind:8} w{workers} worst process {run['max_ms_per_s']:.2f} ms/s, whole server "
                  f"{run['total_ms_per_s']:.2f} ms/s over {run['seconds']:.0f} s (aim ≤ 2 ms/s per process)"
                  + ("" if run["postgres_sessions_opened"] is None else
                     f"; PostgreSQL sessions it opened meanwhile: {run['postgres_sessions_opened']}"))
    print(json.dumps(json_safe(results), allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
