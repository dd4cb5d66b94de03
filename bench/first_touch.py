"""What a silo's first touch costs the server: registering it, and its first approval, beside a warm
approval of the same silo, in CPU time of this one process (the app in-process over a SQLite file;
every request through the HTTP routes a silo uses).

    python bench/first_touch.py               # 16 silos of new terms, 16 that share one silo's terms
    python bench/first_touch.py --silos 40 --seed 3

Each new-terms silo has an (ε, n) and a first round (batch, σ) of its own, so nothing is cached from
another silo: registration validates its budget (its filter is fixed by its first charge), and the
first approval prices a new (q, σ) pair and allocates the filter that charge fixes. A shared-terms
silo repeats one silo's ε, δ, n and first round, as the silos of one consortium often do: both are
then read from the caches. Prints the median and worst of each, and their ratio to a warm approval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi.testclient import TestClient

from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from dpledger.service.store.db import migrate

ADMIN_KEY = "bench-admin-key-0123456789abcdef0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def cpu_ms(call: Any) -> tuple[float, Any]:
    started = time.process_time()
    answer = call()
    return (time.process_time() - started) * 1000, answer


def touch(client: TestClient, name: str, terms: dict[str, Any], unit: dict[str, Any]) -> tuple[float, float, float]:
    """(registration, first approval, warm approval) CPU ms of one silo."""
    register, created = cpu_ms(lambda: client.post("/v1/silos", json={"name": name, **terms}, headers=ADMIN))
    created.raise_for_status()
    silo = created.json()
    headers = {"Authorization": f"Bearer {silo['api_key']}"}
    path = f"/v1/silos/{silo['id']}/charges"
    times = []
    for key in ("first", "warm"):
        spent, answer = cpu_ms(lambda k=key: client.post(path, json={"mechanism": unit, "idempotency_key": k},
                                                         headers=headers))
        assert answer.status_code == 201, answer.text
        times.append(spent)
    return register, times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/ledger.db"
        migrate(url)
        app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY))
        with TestClient(app) as client:
            step = {"type": "dpsgd", "batch_size": 16, "noise_multiplier": 1.0, "steps": 5}
            touch(client, "warm-up", {"epsilon": 3.0, "delta": 1e-5, "dataset_size": 500}, step)  # imports, first pages
            fresh, shared = [], []
            for i in range(args.silos):
                # Terms whose first round fits (q ≤ 0.032, σ ≥ 1, ≤ 10 steps within ε ≥ 2): a refusal is cheaper.
                terms = {"epsilon": round(float(rng.uniform(2.0, 8.0)), 4), "delta": 1e-5,
                         "dataset_size": int(rng.integers(2_000, 50_000))}
                unit = {"type": "dpsgd", "batch_size": int(rng.integers(8, 65)),
                        "noise_multiplier": round(float(rng.uniform(1.0, 3.0)), 4), "steps": int(rng.integers(1, 11))}
                fresh.append(touch(client, f"new-{i}", terms, unit))
                if i == 0:
                    common = (terms, unit)
            for i in range(args.silos):
                shared.append(touch(client, f"shared-{i}", *common))
        app.state.engine.dispose()
    warm = statistics.median(t[2] for t in fresh + shared)
    print(f"CPU ms of one process, {args.silos} silos each (a warm approval: median {warm:.1f} ms)")
    print(f"{'':28}{'median':>8}{'worst':>8}{'÷ warm':>8}")
    for label, rows, column in (("register, new terms", fresh, 0), ("first approval, new terms", fresh, 1),
                                ("register, shared terms", shared, 0), ("first approval, shared terms", shared, 1)):
        values = [row[column] for row in rows]
        median = statistics.median(values)
        print(f"{label:<28}{median:8.1f}{max(values):8.1f}{median / warm:8.1f}")


if __name__ == "__main__":
    main()
