"""Crash: the load of test_load.py while the whole server (uvicorn master and workers) is SIGKILLed
at random moments and restarted on the same port and database. Clients retry transport errors with
the same idempotency key, as the worker does.

Nothing answered is lost, a retried key charges once, no silo goes over budget, the chain verifies,
and every silo's ε is dp-accounting's composition of the charges stored for it. Prints kills,
requests in flight at each kill and retries (`-s`), and writes them to crash.json under tmp_path.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from dpledger.harness import ServerProcess
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import filter_of
from tests.reliability.loadgen import (
    Oracle,
    RunStats,
    make_plan,
    mechanism_pool,
    register_silos,
    run_clients,
    silo_detail,
    steps_of_stored,
    verify_chain,
)

CLIENTS = 64
SILOS = 20
WORKERS = 4
APPROVAL_REQUESTS = 2_000  # with 4 restarts of 4 workers, 60–90 s per database on 2 cores
KILLS = 4
SEED = 7_919


def test_sigkill_loses_nothing_and_charges_each_key_once(ledger_url: str, tmp_path: Path) -> None:
    kind = "postgres" if ledger_url.startswith("postgresql") else "sqlite"
    pool = mechanism_pool()
    oracle = Oracle()
    plans, queue = make_plan(requests=APPROVAL_REQUESTS, silos=SILOS, pool=pool, oracle=oracle, seed=SEED)
    rng = random.Random(SEED)
    # Kill after a random number of finished requests (so the count of kills does not depend on the
    # machine's speed), then after a further random delay of up to 0.2 s (so the moment within a
    # request does).
    thresholds = sorted(rng.sample(range(APPROVAL_REQUESTS // 10, APPROVAL_REQUESTS * 85 // 100), KILLS))
    kills: list[dict[str, float]] = []

    server = ServerProcess(database_url=ledger_url, admin_key=ADMIN_KEY, workers=WORKERS)
    server.start()
    try:
        silos = register_silos(server.url, plans, prefix="crash")

        async def killer(stats: RunStats) -> None:
            for threshold in thresholds:
                while stats.completed < threshold:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(rng.uniform(0.0, 0.2))
                in_flight, completed = stats.in_flight, stats.completed
                await asyncio.to_thread(server.kill)
                down = rng.uniform(0.0, 0.3)
                await asyncio.sleep(down)
                restart = asyncio.get_running_loop().time()
                await asyncio.to_thread(server.start)
                kills.append({"after_requests": completed, "in_flight": in_flight,
                              "restart_s": round(asyncio.get_running_loop().time() - restart + down, 2)})

        outcomes, stats = asyncio.run(
            run_clients(server.url, queue, silos, pool, clients=CLIENTS, retry=True, background=killer)
        )
        approved = [o for o in outcomes if o.status in (200, 201)]
        summary = {
            "database": kind, "workers": WORKERS, "clients": CLIENTS, "approval_requests": len(outcomes),
            "approved": len(approved), "refused": sum(o.status == 409 for o in outcomes), "wall_s": round(stats.wall_s, 1),
            "kills": kills, "transport_errors": stats.transport_errors,
            "approvals_retried": sum(o.transport_errors > 0 for o in outcomes),
            "approvals_replayed": sum(o.replayed for o in outcomes),
            "commits_retried": sum(o.commit_retries > 0 for o in outcomes),
            "commits_found_done": sum(o.commit_status == 409 for o in outcomes),
        }
        print(f"\nCRASH {kind}: {json.dumps(summary)}", flush=True)
        (tmp_path / "crash.json").write_text(json.dumps(summary, indent=2))
        assert len(kills) == KILLS
        assert sum(k["in_flight"] for k in kills) > 0  # the kills did land on requests

        assert Counter(o.status for o in outcomes).keys() <= {200, 201, 409}, Counter(o.status for o in outcomes)
        for o in approved:
            # Retried commits whose first try had landed before a kill find the charge committed.
            committed = (o.commit_status == 200 and o.commit_body["status"] == "committed") or (
                o.commit_status == 409 and o.commit_body.get("charge_status") == "committed"
            )
            assert committed, (o.commit_status, o.commit_body)

        engine = create_engine(ledger_url)
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT id, silo_id, idempotency_key, status, mechanism, epsilon_spent_after FROM charges")
            ).all()
        engine.dispose()
        stored = {row.id: row for row in rows}
        # Every key that got a 201 has exactly one charge, the one it was told about, with the ε it
        # was told; and there is no other charge (a refused key, or a retry, wrote nothing).
        assert len(stored) == len(approved)
        assert len({(row.silo_id, row.idempotency_key) for row in rows}) == len(rows)
        for o in approved:
            row = stored[o.body["charge_id"]]
            assert (row.silo_id, row.idempotency_key) == (silos[o.request.silo].id, o.request.key)
            if o.status == 201:
                assert row.epsilon_spent_after == o.body["epsilon_spent"]
            else:  # a replay (its first answer lost to a kill) states the silo's ε now, never less
                assert o.body["epsilon_spent"] >= row.epsilon_spent_after and o.body["replayed"] is True
            assert row.status == "committed"
            asked = pool[o.request.pool_index]
            assert steps_of_stored(row.mechanism) == ((asked.q, asked.noise_multiplier), asked.steps)

        for silo in silos:
            counts: Counter[tuple[float, float]] = Counter()
            for row in rows:
                if row.silo_id == silo.id and row.status in ("reserved", "committed"):
                    pair, steps = steps_of_stored(row.mechanism)
                    counts[pair] += steps
            detail = silo_detail(server.url, silo.id)
            expected = oracle.epsilon(counts, gate=filter_of(detail))
            assert detail["epsilon_spent"] == pytest.approx(expected, rel=1e-9)
            assert detail["epsilon_committed"] == pytest.approx(expected, rel=1e-9)
            assert expected <= silo.epsilon * (1 + 1e-9)
            assert detail["epsilon_spent"] <= silo.epsilon * (1 + 1e-9)

        report = verify_chain(server.url)
        assert report["ok"] is True, report["problems"][:5]
        refit = sum(silo_detail(server.url, silo.id)["filter"]["source"] == "refit" for silo in silos)  # filter entries
        assert report["entries"] == SILOS + refit + 2 * len(approved)
    finally:
        server.stop()
