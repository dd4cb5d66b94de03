"""What a silo's first touch costs the server: registering it, and its first approval, beside a warm
approval of the same silo, in CPU time of the server's process (a real one-worker server over a SQLite
file, every request through the HTTP routes a silo uses, one at a time).

    python bench/first_touch.py               # 16 silos of new terms, 16 that share one silo's terms
    python bench/first_touch.py --silos 40 --seed 3

Each new-terms silo has an (ε, n) and a first round (batch, σ) of its own, so nothing is cached from
another silo: registration validates its budget (its filter is fixed by its first charge), and the
first approval prices a new (q, σ) pair and allocates the filter that charge fixes. A shared-terms
silo repeats one silo's ε, δ, n and first round, as the silos of one consortium often do: both are
then read from the caches. Prints the median and worst of each, and their ratio to a warm approval.

A request's CPU is the server process's CPU clock (every thread: HTTP, the threadpool, the ledger,
the log's sequencer) from just before it is sent until `--settle` seconds after its answer, when the
sequencer has taken the request's leaf (at rest it gathers leaves up to GATHER_MAX_S, 1 s,
service/ledger/sequencer.py), less the server's rate at rest over that window (measured first). The
client's CPU is not counted. A request that finds the server at rest costs it more than one of a
busy stream (caches gone cold, a sequencer batch of one leaf): a warm approval reads several times
the in-process loop's ~1.2 ms here, as the floor app's paced approval reads 2.5× its full-rate one
(bench/approvals.py --floor).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.harness import ServerProcess
from dpledger.service.ledger.sequencer import GATHER_MAX_S

from _harness import cpu_seconds

ADMIN_KEY = "bench-admin-key-0123456789abcdef0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class ServerClock:
    """The server process's CPU, less its rate at rest, around one request at a time."""

    def __init__(self, pid: int, settle: float) -> None:
        self.process = psutil.Process(pid)
        self.settle = settle
        before = self.read()
        time.sleep(2.0)
        self.rest = (self.read() - before) / 2.0  # CPU seconds a second at rest

    def read(self) -> float:
        value = cpu_seconds(self.process)
        assert value is not None, "the server's CPU clock cannot be read"
        return value

    def ms(self, call: Callable[[], httpx.Response]) -> tuple[float, httpx.Response]:
        started, wall = self.read(), time.perf_counter()
        answer = call()
        time.sleep(self.settle)
        spent = self.read() - started - self.rest * (time.perf_counter() - wall)
        return spent * 1000, answer


def touch(client: httpx.Client, clock: ServerClock, name: str, terms: dict[str, Any],
          unit: dict[str, Any]) -> tuple[float, float, float]:
    """(registration, first approval, warm approval) server CPU ms of one silo."""
    register, created = clock.ms(lambda: client.post("/v1/silos", json={"name": name, **terms}, headers=ADMIN))
    created.raise_for_status()
    silo = created.json()
    headers = {"Authorization": f"Bearer {silo['api_key']}"}
    path = f"/v1/silos/{silo['id']}/charges"
    times = []
    for key in ("first", "warm"):
        spent, answer = clock.ms(lambda k=key: client.post(path, json={"mechanism": unit, "idempotency_key": k},
                                                           headers=headers))
        assert answer.status_code == 201, answer.text
        times.append(spent)
    return register, times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle", type=float, default=GATHER_MAX_S + 0.25,
                        help="seconds counted after each answer, for the log's sequencer to take its leaf")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server is stopped on the way out
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as folder, ServerProcess(
        database_url=f"sqlite:///{folder}/ledger.db", admin_key=ADMIN_KEY, workers=1,
    ) as server, httpx.Client(base_url=server.url, timeout=60.0) as client:
        assert server.process is not None
        clock = ServerClock(server.process.pid, args.settle)
        step = {"type": "dpsgd", "batch_size": 16, "noise_multiplier": 1.0, "steps": 5}
        touch(client, clock, "warm-up", {"epsilon": 3.0, "delta": 1e-5, "dataset_size": 500}, step)  # first pages
        fresh, shared = [], []
        for i in range(args.silos):
            # Terms whose first round fits (q ≤ 0.032, σ ≥ 1, ≤ 10 steps within ε ≥ 2): a refusal is cheaper.
            terms = {"epsilon": round(float(rng.uniform(2.0, 8.0)), 4), "delta": 1e-5,
                     "dataset_size": int(rng.integers(2_000, 50_000))}
            unit = {"type": "dpsgd", "batch_size": int(rng.integers(8, 65)),
                    "noise_multiplier": round(float(rng.uniform(1.0, 3.0)), 4), "steps": int(rng.integers(1, 11))}
            fresh.append(touch(client, clock, f"new-{i}", terms, unit))
            if i == 0:
                common = (terms, unit)
        for i in range(args.silos):
            shared.append(touch(client, clock, f"shared-{i}", *common))
    warm = statistics.median(t[2] for t in fresh + shared)
    print(f"server CPU ms, one worker, SQLite, {args.silos} silos each (at rest {clock.rest * 1e3:.2f} ms/s, "
          f"subtracted; a warm approval: median {warm:.2f} ms)")
    print(f"{'':28}{'median':>8}{'worst':>8}{'÷ warm':>8}{'aim':>6}")
    for label, rows, column, aim in (("register, new terms", fresh, 0, 10), ("first approval, new terms", fresh, 1, 15),
                                     ("register, shared terms", shared, 0, 10),
                                     ("first approval, shared terms", shared, 1, 15)):
        values = [row[column] for row in rows]
        median = statistics.median(values)
        print(f"{label:<28}{median:8.2f}{max(values):8.2f}{median / warm:8.1f}{aim:6}")


if __name__ == "__main__":
    main()
