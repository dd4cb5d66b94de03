"""Approvals across silos on PostgreSQL with several uvicorn workers: do silos still meet at a lock?

Runs a server (`dpledger.harness.running_server`, `--workers`, default 4) on a fresh `public` schema
and, for `--seconds` each, closed-loop clients that reserve charges (one keep-alive connection and one
request at a time each):

* 1 silo, 1 client, then `--silos` silos (default 8), one client each: approvals/s and their ratio;
* meanwhile, every 10 ms, from pg_stat_activity: backends waiting on a lock (wait_event_type =
  'Lock'), and backends inside a writing transaction (backend_xid set: an approval holds its silo's
  row from its first statement, `SELECT … FOR UPDATE`, to its commit);
* the lock hold time per approval by Little's law (mean writing transactions / approvals per second),
  and the approvals/s that one lock held that long would cap at (1 / hold): under the log's single
  state row every silo's approval queued behind it; now each silo's approvals queue only behind
  their own silo's.

State the machine: the core count is printed; on 2 cores, 8 clients and 4 workers share them, so the
throughput ratio says little, while waiting backends and hold times do.

    python bench/multi_silo.py [--pg-url URL] [--workers 4] [--silos 8] [--seconds 10]

Prints a table, then one JSON line with every figure. Runs against whatever dpledger is importable
(PYTHONPATH), so an older checkout's install can be measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from sqlalchemy import create_engine, text

from dpledger.harness import running_server

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
ADMIN_KEY = "bench-admin-key-0123456789abcdef"
STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
HORIZON = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
SAMPLE_S = 0.01


class Sampler:
    """pg_stat_activity every SAMPLE_S on a connection of its own (its own backend left out)."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)
        self.waiting: list[int] = []
        self.writing: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        query = text("SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), count(*) FILTER (WHERE backend_xid IS NOT NULL) "
                     "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with self.engine.connect() as connection:
            while not self._stop.is_set():
                waiting, writing = connection.execute(query).one()
                connection.commit()
                self.waiting.append(int(waiting))
                self.writing.append(int(writing))
                time.sleep(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()


async def _client(url: str, silo: dict[str, Any], until: float, counter: list[int], tag: str) -> None:
    headers = {"Authorization": f"Bearer {silo['api_key']}"}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        n = 0
        while time.monotonic() < until:
            response = await http.post(f"/v1/silos/{silo['id']}/charges", headers=headers,
                                       json={"mechanism": STEP, "idempotency_key": f"{tag}-{n}"})
            if response.status_code != 201:
                raise RuntimeError(f"{response.status_code}: {response.text}")
            n += 1
        counter.append(n)


def phase(url: str, pg_url: str, silos: list[dict[str, Any]], seconds: float, tag: str) -> dict[str, float]:
    counts: list[int] = []

    async def run() -> None:
        until = time.monotonic() + seconds
        await asyncio.gather(*(_client(url, s, until, counts, f"{tag}{i}") for i, s in enumerate(silos)))

    with Sampler(pg_url) as sampler:
        start = time.monotonic()
        asyncio.run(run())
        wall = time.monotonic() - start
    rate = sum(counts) / wall
    writing = statistics.fmean(sampler.writing)
    hold = writing / rate  # Little's law: mean transactions holding a row lock / approvals per second
    return {"silos": len(silos), "approvals": sum(counts), "approvals_per_s": round(rate, 1),
            "waiting_on_lock_mean": round(statistics.fmean(sampler.waiting), 3),
            "waiting_on_lock_max": max(sampler.waiting), "writing_txn_mean": round(writing, 3),
            "lock_hold_ms_per_approval": round(1000 * hold, 2), "one_lock_would_cap_at_per_s": round(1 / hold, 1),
            "samples": len(sampler.waiting)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=os.environ.get("DPLEDGER_BENCH_POSTGRES_URL", DEFAULT_PG_URL))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--silos", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    engine = create_engine(args.pg_url)
    with engine.begin() as connection:
        connection.execute(text("DROP SCHEMA public CASCADE"))
        connection.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    with running_server(database_url=args.pg_url, admin_key=ADMIN_KEY, workers=args.workers) as url:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        silos = [httpx.post(f"{url}/v1/silos", headers=admin, timeout=60, json={
            "name": f"bench-{i}", "epsilon": 1e4, "delta": 1e-5, "dataset_size": 1000, "horizon": HORIZON}).json()
            for i in range(args.silos)]
        if any("api_key" not in s for s in silos):
            raise SystemExit(f"could not register the silos: {silos[0]}")
        phase(url, args.pg_url, silos, 2.0, "warm")  # curves cached, connections open in every worker
        one = phase(url, args.pg_url, silos[:1], args.seconds, "one")
        many = phase(url, args.pg_url, silos, args.seconds, "many")
    result = {"cores": os.cpu_count(), "workers": args.workers, "seconds": args.seconds, "one_silo": one,
              "many_silos": many, "throughput_ratio": round(many["approvals_per_s"] / one["approvals_per_s"], 2)}
    print(f"cores {os.cpu_count()}, PostgreSQL, {args.workers} workers, {args.seconds:g} s a phase")
    print(f"{'':>10} {'appr/s':>8} {'waiting (mean/max)':>19} {'hold ms/approval':>17} {'one lock caps at/s':>19}")
    for name, row in (("1 silo", one), (f"{args.silos} silos", many)):
        print(f"{name:>10} {row['approvals_per_s']:>8} {row['waiting_on_lock_mean']:>12}/{row['waiting_on_lock_max']:<6} "
              f"{row['lock_hold_ms_per_approval']:>17} {row['one_lock_would_cap_at_per_s']:>19}")
    print(f"throughput {args.silos} silos / 1 silo: {result['throughput_ratio']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
