"""Hostile requests against a real server (issue 46): the issue's table, then a seeded search over
hostile mechanisms and request shapes (tests/service/hostile.py), each request sent once; prints the
server's CPU (its process tree, from /proc) and peak memory growth per request, the worst found, and
any 5xx. Then item 2: 16 worst-case requests in parallel from one key, beside another silo's
approvals, whose latency is compared with its quiet one.

    python bench/hostile_requests.py [--seconds 40] [--seed 0]

Goal: the worst request ≤ 2 s of server CPU and ≤ 256 MB, or a 4xx in ≤ 50 ms; no 5xx.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.harness import ServerProcess
from tests.service import hostile

ADMIN_KEY = "bench-admin-key-0123456789abcdef"


def server_cpu(pid: int) -> float:
    """utime + stime of the serving process (one worker: the server is this one process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the seeded search runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    url = f"sqlite:///{tempfile.mkdtemp()}/ledger.db"
    with ServerProcess(database_url=url, admin_key=ADMIN_KEY, workers=1) as server:
        assert server.process is not None
        process = server.process.pid
        http = httpx.Client(base_url=server.url, timeout=120)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

        def silo(name: str, **extra: Any) -> dict[str, Any]:
            body = {"name": name, "epsilon": 1000.0, "delta": 1e-5, "dataset_size": hostile.DATASET_SIZE, **extra}
            made: dict[str, Any] = http.post("/v1/silos", json=body, headers=admin).json()
            return made

        plain, replace = silo("plain"), silo("replace", relation="replace_one")
        keys = {"admin": admin, "silo": {"Authorization": f"Bearer {plain['api_key']}"}}
        rss0 = peak_rss(process)
        found: list[tuple[float, float, int, float, str]] = []

        def send(name: str, path: str, body: dict[str, Any], who: str) -> None:
            before, started = server_cpu(process), time.perf_counter()
            answer = http.post(path, json=body, headers=keys[who])
            wall, cpu = time.perf_counter() - started, server_cpu(process) - before
            found.append((cpu, wall, answer.status_code, (peak_rss(process) - rss0) / 2**20, name))

        print("the issue's table (server CPU s, wall s, status, peak memory growth MB):")
        for name, path, body, who in hostile.table(plain["id"], replace["id"]):
            send(name, path, body, who)
            cpu, wall, code, grown, _ = found[-1]
            print(f"  {cpu:5.2f} {wall:5.2f} {code} {grown:6.0f}  {name}", flush=True)
        rng = random.Random(args.seed)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            path, body, who = hostile.request(rng, silo_id=plain["id"], replace_one_silo_id=replace["id"])
            send(path, path, body, who)
        searched = found[8:]
        print(f"a seeded search (seed {args.seed}): {len(searched)} requests; 5xx: "
              f"{sum(1 for f in found if f[2] >= 500)}; statuses {sorted({f[2] for f in found})}")
        print("worst five by server CPU:")
        for cpu, wall, code, grown, name in sorted(found, reverse=True)[:5]:
            print(f"  {cpu:5.2f} s CPU {wall:5.2f} s wall {code} {grown:6.0f} MB  {name}")
        slow_refusals = [f for f in found if 400 <= f[2] < 500 and f[0] > 0.05]
        print(f"4xx answers over 50 ms of server CPU: {len(slow_refusals)}"
              + ("" if not slow_refusals else f" (worst {max(slow_refusals)[0]:.2f} s: {max(slow_refusals)[4]})"))
        print(f"peak memory growth over the run: {(peak_rss(process) - rss0) / 2**20:.0f} MB")
        parallel(http, admin, silo)


def parallel(http: httpx.Client, admin: dict[str, str], silo: Any, *, seconds: float = 6.0, rounds: int = 3) -> None:
    """Item 2: one key keeps 16 worst-case requests in flight (each thread sends its next as soon as
    it has an answer, after Retry-After on a 429),
    while another silo's approvals run; their median latency beside the attack against the quiet one,
    in alternating windows, several rounds (one window is too noisy on a shared box)."""
    other = silo("other")
    headers = {"Authorization": f"Bearer {other['api_key']}"}
    step = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}
    counter = iter(range(10**7))

    def approvals(until: float) -> list[float]:
        out = []
        while time.monotonic() < until:
            started = time.perf_counter()
            http.post(f"/v1/silos/{other['id']}/charges", json={"mechanism": step, "idempotency_key": f"k{next(counter)}"},
                      headers=headers)
            out.append(time.perf_counter() - started)
        return out

    heavy = {"delta": 1e-5, "mechanism": {"type": "dpsgd", "sampling_rate": 0.999, "noise_multiplier": 0.5, "steps": 5}}
    ratios: list[float] = []
    codes: list[int] = []
    for _ in range(rounds):
        quiet = statistics.median(approvals(time.monotonic() + seconds / 2))
        stop = time.monotonic() + seconds

        def hostile_key(i: int, stop: float = stop) -> None:
            n = 0
            with httpx.Client(base_url=str(http.base_url), timeout=120) as own:
                while time.monotonic() < stop:
                    n += 1  # a new mechanism each time: nothing is cached
                    body = {**heavy, "mechanism": {**heavy["mechanism"], "steps": 5 + 1000 * i + n}}
                    answer = own.post("/v1/quote", json=body, headers=admin)
                    code = answer.status_code
                    codes.append(code)
                    if code == 429:  # as the answer says (a flood of refused requests is a proxy's to limit)
                        time.sleep(float(answer.headers["Retry-After"]))

        threads = [threading.Thread(target=hostile_key, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # the attack under way
        loaded = statistics.median(approvals(stop))
        for thread in threads:
            thread.join()
        ratios.append(loaded / quiet)
        print(f"  another silo's approval median {quiet * 1000:.1f} ms quiet, {loaded * 1000:.1f} ms beside the attack "
              f"({loaded / quiet:.2f}×)", flush=True)
    print(f"16 worst-case quotes kept in flight by one key ({codes.count(200)} answered, {codes.count(429)} × 429): "
          f"another silo's approvals {statistics.median(ratios):.2f}× their quiet latency (median of {rounds} rounds; "
          f"worst {max(ratios):.2f}×)")


if __name__ == "__main__":
    main()
