"""Load: 64 concurrent clients against 4 uvicorn workers, 20 silos of which half run out of budget.

Afterwards every silo's ε is dp-accounting's composition of exactly the charges it approved, no
silo is over budget, every refusal was a budget refusal that was right at the moment it was made
(checked against the silo's history and the clients' own clocks), and the chain verifies.
Prints requests/s and p50/p99 latency (`-s`) and writes them to load.json under the test's tmp_path.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from dpledger.harness import ServerProcess
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import filter_of
from tests.reliability.loadgen import (
    Oracle,
    Outcome,
    PoolMechanism,
    Silo,
    latency_summary,
    make_plan,
    mechanism_pool,
    register_silos,
    run_clients,
    silo_detail,
    silo_history,
    steps_by_pair,
    steps_of_stored,
    verify_chain,
)

CLIENTS = 64
SILOS = 20
WORKERS = 4
# 4,000 approvals on both databases; each approved one is committed too, so a run is ~5,000 HTTP
# requests from 64 clients (40–70 s on 2 cores). bench/approvals.py runs the long version.
APPROVAL_REQUESTS = 4_000


def test_load_keeps_every_silo_exact_and_within_budget(ledger_url: str, tmp_path: Path) -> None:
    kind = "postgres" if ledger_url.startswith("postgresql") else "sqlite"
    pool = mechanism_pool()
    oracle = Oracle()
    plans, queue = make_plan(requests=APPROVAL_REQUESTS, silos=SILOS, pool=pool, oracle=oracle, seed=20_240_611)

    with ServerProcess(database_url=ledger_url, admin_key=ADMIN_KEY, workers=WORKERS) as server:
        silos = register_silos(server.url, plans, prefix="load")
        outcomes, stats = asyncio.run(run_clients(server.url, queue, silos, pool, clients=CLIENTS))
        summary = {"database": kind, "workers": WORKERS, "clients": CLIENTS, **latency_summary(outcomes, stats)}
        print(f"\nLOAD {kind}: {json.dumps(summary)}", flush=True)
        (tmp_path / "load.json").write_text(json.dumps(summary, indent=2))

        assert Counter(o.status for o in outcomes).keys() <= {200, 201, 409}, Counter(o.status for o in outcomes)
        for outcome in outcomes:
            if outcome.status in (200, 201):
                assert (outcome.commit_status, outcome.commit_body["status"]) == (200, "committed"), outcome.commit_body
            else:
                assert outcome.body["epsilon_if_approved"] > outcome.body["epsilon"], outcome.body

        by_silo: dict[int, list[Outcome]] = {s.index: [] for s in silos}
        for outcome in outcomes:
            by_silo[outcome.request.silo].append(outcome)
        for silo in silos:
            check_silo(server.url, silo, by_silo[silo.index], pool, oracle)

        # One silo's composition, rebuilt with a fresh RdpAccountant per SelfComposedDpEvent: the
        # cached Σ count·curve of the oracle is the same composition.
        first = [pool[o.request.pool_index] for o in by_silo[0] if o.status in (200, 201)]
        oracle.check_self_composition(steps_by_pair(first))

        report = verify_chain(server.url)
        assert report["ok"] is True, report["problems"][:5]
        approved = sum(o.status in (200, 201) for o in outcomes)
        # create, a filter entry where the first charge refit the horizon's filter, reserve + commit per approval
        refit = sum(silo_detail(server.url, silo.id)["filter"]["source"] == "refit" for silo in silos)
        assert report["entries"] == SILOS + refit + 2 * approved


def check_silo(url: str, silo: Silo, outcomes: list[Outcome], pool: Sequence[PoolMechanism], oracle: Oracle) -> None:
    approved = [o for o in outcomes if o.status in (200, 201)]
    refused = [o for o in outcomes if o.status == 409]
    # Half the silos were given less than their plan costs: they must have been refused something;
    # the others were given 1.5x their plan and must never be.
    assert bool(refused) == silo.runs_out, (silo, len(refused))

    history = silo_history(url, silo.id)
    reserves = [e for e in history if e["event"] == "reserve"]
    assert [e["event"] for e in history].count("commit") == len(approved)
    assert {e["charge_id"] for e in reserves} == {o.body["charge_id"] for o in approved}
    outcome_of = {o.body["charge_id"]: o for o in approved}
    stored_pairs = []
    for entry in reserves:
        pair, steps = steps_of_stored(entry["mechanism"])
        asked = pool[outcome_of[entry["charge_id"]].request.pool_index]
        # q derived by the service from batch_size / the registered size, or taken as declared
        assert (pair, steps) == ((asked.q, asked.noise_multiplier), asked.steps)
        stored_pairs.append((pair, steps))

    detail = silo_detail(url, silo.id)
    gate = filter_of(detail)  # the orders and δ shares the silo committed to at registration
    expected = oracle.epsilon(steps_by_pair([pool[o.request.pool_index] for o in approved]), gate=gate)
    assert detail["epsilon_spent"] == pytest.approx(expected, rel=1e-9)
    assert detail["epsilon_committed"] == pytest.approx(expected, rel=1e-9)
    assert expected <= silo.epsilon * (1 + 1e-9)
    assert detail["epsilon_spent"] <= silo.epsilon * (1 + 1e-9)

    if not refused:
        return
    # ε after each prefix of the approval order (the chain's order: the silo row lock serialises them)
    prefix = np.zeros((len(stored_pairs) + 1, len(oracle.curve(*stored_pairs[0][0]))))
    for k, ((q, sigma), steps) in enumerate(stored_pairs):
        prefix[k + 1] = prefix[k] + steps * oracle.curve(q, sigma)
    prefix_eps = np.array([oracle.epsilon_of_curve(c, gate=gate) for c in prefix])
    assert np.all(np.diff(prefix_eps) > 0)
    position = {e["charge_id"]: k for k, e in enumerate(reserves)}
    for r in refused:
        # Which state the refusal saw: the prefix whose ε it reports.
        k = int(np.argmin(np.abs(prefix_eps - r.body["epsilon_spent"])))
        assert prefix_eps[k] == pytest.approx(r.body["epsilon_spent"], rel=1e-9)
        m = pool[r.request.pool_index]
        with_it = oracle.epsilon_of_curve(prefix[k] + m.steps * oracle.curve(m.q, m.noise_multiplier), gate=gate)
        assert with_it > silo.epsilon, (with_it, silo.epsilon)
        assert with_it == pytest.approx(r.body["epsilon_if_approved"], rel=1e-9)
        # ...and that state is one the refusal could have seen: every approval answered before it
        # was sent is in it, none sent after it was answered is.
        for a in approved:
            if a.t_recv < r.t_send:
                assert position[a.body["charge_id"]] < k
            elif a.t_send > r.t_recv:
                assert position[a.body["charge_id"]] >= k
