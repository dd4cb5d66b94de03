"""Server instructions per approval, this tree beside another install, counted by valgrind.

On a shared 2-core machine the server's CPU per approval (`approvals.py --cpu-compare`) moves by
±20% from one run to the next, more than most changes to the approval path are worth. Instructions
retired hardly depend on what else the machine runs (counts of one build differ by up to 4%), so
they compare two builds in one run. Cachegrind counts the user-space instructions of the
one-worker server (HTTP, the threadpool, the ledger, the log's sequencer; not the kernel's work,
such as fsync) while the bench's 16 clients send approvals of one repeated (q, σ) pair to a fresh silo. Start-up, the import
of every module and the silo's registration cost the same whatever the count, so the bench runs each
build twice, with `--small` and `--large` approvals, and reports the difference over the difference.

    python bench/instructions.py --compare /path/to/older/site     # ~8 min on 2 cores
    python bench/instructions.py --floor      # this tree beside the stack's floor app (bench/_floor.py)

valgrind runs the server ~10× slower than it runs alone (about 16 approvals/s against 160 here), and
the log's sequencer wakes every 100 ms of wall time: the bench runs it every `--sequence-interval-ms`
(1000) instead, so that a batch holds about as many leaves as at full speed. (d08cbf2 counted 10.82 M
an approval at 100 ms and 10.83 M at 1000 ms: the figures hardly depend on it.) They are
instructions, not times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from approvals import _MIGRATE, ADMIN_KEY, BENCH, FLOOR, REPEATED_SIGMA, create_small_silo, fire

from dpledger.harness import free_port

from _harness import RawClient, log

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def _server_instructions(site: str | None, approvals: int, args: argparse.Namespace, tmp: str) -> int:
    """User-space instructions of a one-worker server of `site` (None: this tree) that served `approvals`."""
    url = f"sqlite:///{tmp}/ledger.db"
    env = {**os.environ, "DATABASE_URL": url, "DPLEDGER_ADMIN_KEY": ADMIN_KEY,
           "DPLEDGER_LOG_SEQUENCE_INTERVAL_MS": str(args.sequence_interval_ms)}
    port = free_port()
    if site == FLOOR:  # the stack's floor app (bench/_floor.py), on its own table of the same file
        env.update(PYTHONPATH=BENCH, FLOOR_DATABASE_URL=url)
        served = ["-m", "uvicorn", "--factory", "_floor:make_app", "--port", str(port), "--log-level", "warning"]
    else:
        if site is not None:
            env["PYTHONPATH"] = site
        subprocess.run([sys.executable, "-c", _MIGRATE, url], env=env, cwd=tmp, check=True)
        served = ["-m", "dpledger.service.serving", "--port", str(port), "--log-level", "warning"]
    report = f"{tmp}/valgrind.log"
    process = subprocess.Popen(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", f"--log-file={report}",
         sys.executable, *served], env=env, cwd=tmp, start_new_session=True)
    server = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server of {site or 'this tree'} did not answer under valgrind")
            try:
                if httpx.get(f"{server}/healthz", timeout=5.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1.0)
        asyncio.run(_approvals(server, approvals, args.concurrency, floor=site == FLOOR))
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # valgrind writes its totals as the server exits
        process.wait()
    found = _REFS.search(Path(report).read_text())
    if found is None:
        raise RuntimeError(f"valgrind reported no instruction count: {report}")
    return int(found.group(1).replace(",", ""))


async def _approvals(server: str, n: int, concurrency: int, *, floor: bool) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=600.0) as admin:
        loader = RawClient(server, concurrency)
        silo = {"id": 1, "api_key": "floor"} if floor else await create_small_silo(admin, loader, "instructions")
        await fire(loader, silo, n, concurrency, sigma_of=lambda: REPEATED_SIGMA, tag="counted", tally=None,
                   server_root=None)
        await loader.aclose()


def per_approval(site: str | None, args: argparse.Namespace) -> float:
    counts = []
    for n in (args.small, args.large):
        with tempfile.TemporaryDirectory(prefix="dpledger-instructions-") as tmp:
            counts.append(_server_instructions(site, n, args, tmp))
        log(f"{site or 'this tree'}: {n} approvals, {counts[-1] / 1e9:.3f} G instructions in all")
    return (counts[1] - counts[0]) / (args.large - args.small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="SITE", help="an older install (pip install --no-deps --target SITE)")
    parser.add_argument("--floor", action="store_true", help="compare with the stack's floor app (bench/_floor.py)")
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sequence-interval-ms", type=int, default=1000,
                        help="the log sequencer's interval under valgrind (100 ms at full speed)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    before = FLOOR if args.floor else args.compare
    trees = {"before": before, "after": None} if before else {"this tree": None}
    results = {name: per_approval(site, args) for name, site in trees.items()}
    print(f"server instructions per approval (valgrind cachegrind, 1 worker, SQLite, {args.concurrency} clients, "
          f"repeated (q, σ) pair, sequencer every {args.sequence_interval_ms} ms; "
          f"({args.large} − {args.small} approvals) apart)")
    for name, value in results.items():
        print(f"{name:10} {value / 1e6:8.3f} M")
    if before:
        print(f"after / before{' (the floor)' if args.floor else ''}: {results['after'] / results['before']:.3f}")
    print(json.dumps({"instructions_per_approval": results}))


if __name__ == "__main__":
    main()
