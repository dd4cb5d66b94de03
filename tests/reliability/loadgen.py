"""Load generation against a real server, and an ε oracle built on dp-accounting.

The oracle builds `dp_accounting` events itself and composes them at the order grid the service
uses, and converts them with dp-accounting's conversion at the orders and δ shares of the silo's
published filter (tests/gate_oracle.py), so a bug in our mechanism mapping, our running sums or our
gate shows up as a disagreement. The one thing it shares with the service is the certified value of
a Poisson-sampled Gaussian at fractional orders, which tests/service/accounting/test_fractional.py
checks against a 40-digit integration.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting.cost import MAX_SAMPLED_LEAVES
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import proven_epsilon, sampled_gaussian_curve

# The grid is configuration, not math: take it from dp-accounting, as the service says it does.
ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)
DELTA = 1e-5
# One size for every silo, so a batch_size resolves to the same q everywhere and the server
# computes 20 curves per worker, not 20 per silo per worker.
DATASET_SIZE = 50_000
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass(frozen=True)
class PoolMechanism:
    noise_multiplier: float
    steps: int
    sampling_rate: float | None = None
    batch_size: int | None = None

    @property
    def q(self) -> float:
        if self.sampling_rate is not None:
            return self.sampling_rate
        assert self.batch_size is not None
        return self.batch_size / DATASET_SIZE

    def wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "dpsgd", "noise_multiplier": self.noise_multiplier, "steps": self.steps}
        if self.sampling_rate is not None:
            body["sampling_rate"] = self.sampling_rate
        else:
            body["batch_size"] = self.batch_size
        return body


def mechanism_pool() -> list[PoolMechanism]:
    """15 DP-SGD (q, σ) pairs, each as a batch size that the service turns into q against the silo's
    registered size (a silo's charge may not declare its own rate); no two share a q. 15: a silo declares
    its whole workload as its horizon, and one request holds at most 15 distinct sampled leaves."""
    pool = []
    for i in range(10):
        pool.append(PoolMechanism(noise_multiplier=0.8 + 0.1 * i, steps=1 + i % 3, batch_size=50 * (i + 1) + 1))
        if i < 5:
            pool.append(PoolMechanism(noise_multiplier=1.25 + 0.1 * i, steps=2 + i % 2, batch_size=64 + 48 * i))
    assert len(pool) == MAX_SAMPLED_LEAVES
    return pool


class Oracle:
    """ε of a multiset of DP-SGD steps by dp-accounting's RdpAccountant alone.

    dp-accounting needs ~20-50 ms for one Poisson-sampled Gaussian curve, so each (q, σ) pair's
    one-step curve is computed once; a composition is then Σ count·curve, which is exactly what
    RdpAccountant does for SelfComposedDpEvent(event, count) (checked by `check_self_composition`),
    and ε is read off by dp-accounting's own conversion."""

    def __init__(self) -> None:
        self._curves: dict[tuple[float, float], np.ndarray] = {}
        self._certified: dict[tuple[float, float], np.ndarray] = {}

    def dp_accounting_curve(self, q: float, sigma: float) -> np.ndarray:
        key = (q, sigma)
        if key not in self._curves:
            accountant = rdp_lib.RdpAccountant(list(ORDERS))
            accountant.compose(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)))
            self._curves[key] = accountant.rdp
        return self._curves[key]

    def curve(self, q: float, sigma: float) -> np.ndarray:
        """The curve the ledger charges: dp-accounting's, certified at fractional orders."""
        key = (q, sigma)
        if key not in self._certified:
            self._certified[key] = np.minimum(self.dp_accounting_curve(q, sigma), sampled_gaussian_curve(q, sigma))
        return self._certified[key]

    def total(self, steps_by_pair: Counter[tuple[float, float]], *, certified: bool = True) -> np.ndarray:
        total = np.zeros(len(ORDERS))
        for (q, sigma), steps in sorted(steps_by_pair.items()):
            total = total + steps * (self.curve(q, sigma) if certified else self.dp_accounting_curve(q, sigma))
        return total

    def epsilon_of_curve(
        self, curve: np.ndarray, delta: float = DELTA, *, gate: list[tuple[float, float]] | None = None
    ) -> float:
        """dp-accounting's conversion: at the silo's filter (`gate`: its orders and δ shares) when
        given, else the minimum over all orders at the whole δ (the rule before the filter)."""
        if gate is not None:
            return proven_epsilon(gate, curve, delta=delta)
        return float(rdp_lib.compute_epsilon(ORDERS, curve, delta)[0])

    def epsilon(
        self, steps_by_pair: Counter[tuple[float, float]], delta: float = DELTA, *, gate: list[tuple[float, float]] | None = None
    ) -> float:
        return self.epsilon_of_curve(self.total(steps_by_pair, certified=gate is not None), delta, gate=gate)

    def check_self_composition(self, steps_by_pair: Counter[tuple[float, float]], delta: float = DELTA) -> None:
        """The cached sum equals a fresh RdpAccountant composing one SelfComposedDpEvent per pair."""
        accountant = rdp_lib.RdpAccountant(list(ORDERS))
        for (q, sigma), steps in sorted(steps_by_pair.items()):
            accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps))
        expected = accountant.get_epsilon(delta)
        got = self.epsilon(steps_by_pair, delta)
        assert abs(got - expected) <= 1e-12 * expected, (got, expected)


def steps_by_pair(mechanisms: Sequence[PoolMechanism]) -> Counter[tuple[float, float]]:
    counts: Counter[tuple[float, float]] = Counter()
    for m in mechanisms:
        counts[(m.q, m.noise_multiplier)] += m.steps
    return counts


def steps_of_stored(mechanism_json: str | dict[str, Any]) -> tuple[tuple[float, float], int]:
    """The (q, σ) pair and step count of a charge's stored (resolved) mechanism."""
    m = json.loads(mechanism_json) if isinstance(mechanism_json, str) else mechanism_json
    assert m["type"] == "dpsgd", m
    return (float(m["sampling_rate"]), float(m["noise_multiplier"])), int(m["steps"])


# --------------------------------------------------------------------------------------------------
# The plan: which silo asks for which mechanism, and with which budgets


@dataclass(frozen=True)
class SiloPlan:
    index: int
    epsilon: float
    runs_out: bool
    mechanisms: list[int]  # pool indices, in the order this silo's requests are queued


@dataclass(frozen=True)
class Silo:
    index: int
    id: int
    key: str
    epsilon: float
    runs_out: bool

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass(frozen=True)
class PlannedRequest:
    silo: int
    pool_index: int
    key: str


def make_plan(
    *, requests: int, silos: int, pool: Sequence[PoolMechanism], oracle: Oracle, seed: int, spend_fraction: float = 0.3
) -> tuple[list[SiloPlan], list[PlannedRequest]]:
    """Half the silos get 1.5× what their whole plan costs (never refused); the other half get what
    the first `spend_fraction` of their plan costs, so they run out whatever the interleaving."""
    rng = random.Random(seed)
    per_silo: list[list[int]] = [[] for _ in range(silos)]
    order = [i % silos for i in range(requests)]
    rng.shuffle(order)
    queue = []
    for n, s in enumerate(order):
        p = rng.randrange(len(pool))
        per_silo[s].append(p)
        queue.append(PlannedRequest(silo=s, pool_index=p, key=f"req-{n}"))
    plans = []
    for s, picks in enumerate(per_silo):
        runs_out = s % 2 == 1
        mechanisms = [pool[p] for p in picks]
        if runs_out:
            epsilon = oracle.epsilon(steps_by_pair(mechanisms[: max(1, int(len(mechanisms) * spend_fraction))]))
        else:
            epsilon = 1.5 * oracle.epsilon(steps_by_pair(mechanisms))
        plans.append(SiloPlan(index=s, epsilon=epsilon, runs_out=runs_out, mechanisms=picks))
    return plans, queue


def horizon(plan: SiloPlan) -> dict[str, Any]:
    """The workload the silo will charge, declared at registration so its filter commits to the
    order where that workload is cheapest (each distinct mechanism once, with its count)."""
    pool, counts = mechanism_pool(), Counter(plan.mechanisms)
    events = [{"type": "self_composed", "count": n, "event": pool[p].wire()} for p, n in sorted(counts.items())]
    return {"type": "composed", "events": events}


def register_silos(url: str, plans: Sequence[SiloPlan], *, prefix: str) -> list[Silo]:
    out = []
    with httpx.Client(base_url=url, headers=ADMIN, timeout=60) as client:
        for plan in plans:
            body = {"name": f"{prefix}-{plan.index}", "epsilon": plan.epsilon, "delta": DELTA, "dataset_size": DATASET_SIZE,
                    "horizon": horizon(plan)}
            response = client.post("/v1/silos", json=body)
            assert response.status_code == 201, response.text
            data = response.json()
            out.append(Silo(index=plan.index, id=data["id"], key=data["api_key"], epsilon=plan.epsilon, runs_out=plan.runs_out))
    return out


# --------------------------------------------------------------------------------------------------
# The clients


@dataclass
class Outcome:
    """What the client saw for one idempotency key, over all its attempts."""

    request: PlannedRequest
    status: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    answers: list[tuple[int, int | None]] = field(default_factory=list)  # (status, charge_id) of each answer
    replayed: int = 0  # answers marked Idempotent-Replayed
    transport_errors: int = 0
    t_send: float = 0.0  # of the attempt that got the final answer
    t_recv: float = 0.0
    latency: float = 0.0
    commit_status: int | None = None
    commit_body: dict[str, Any] = field(default_factory=dict)
    commit_retries: int = 0


@dataclass
class RunStats:
    wall_s: float = 0.0
    http_requests: int = 0
    transport_errors: int = 0
    in_flight: int = 0
    completed: int = 0
    commit_latencies: list[float] = field(default_factory=list)


async def _send(
    client: httpx.AsyncClient, method: str, path: str, stats: RunStats, *, retry: bool, **kwargs: Any
) -> tuple[httpx.Response, int, float, float]:
    """One logical request; with `retry`, transport errors (a killed server) are retried as the
    worker does: same body, same idempotency key, short backoff. Returns (response, retries, sent, received)."""
    retries = 0
    while True:
        stats.in_flight += 1
        t_send = time.monotonic()
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.TransportError:
            stats.transport_errors += 1
            if not retry or retries >= 400:
                raise
            retries += 1
            await asyncio.sleep(min(0.5, 0.02 * 2 ** min(retries, 5)) * (0.5 + random.random()))
            continue
        finally:
            stats.in_flight -= 1
            stats.http_requests += 1
        return response, retries, t_send, time.monotonic()


async def run_clients(
    url: str,
    queue: Sequence[PlannedRequest],
    silos: Sequence[Silo],
    pool: Sequence[PoolMechanism],
    *,
    clients: int,
    retry: bool = False,
    background: Callable[[RunStats], Awaitable[None]] | None = None,
) -> tuple[list[Outcome], RunStats]:
    """`clients` closed-loop clients, each with its own connection, take requests off one shared
    queue; each approved charge is committed at once by the client that got it."""
    stats = RunStats()
    outcomes = [Outcome(request=r) for r in queue]
    next_index = iter(range(len(queue)))

    async def client_loop() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            for i in next_index:
                outcome = outcomes[i]
                request = outcome.request
                silo = silos[request.silo]
                body = {"mechanism": pool[request.pool_index].wire(), "idempotency_key": request.key,
                        "job_id": "reliability", "round": i}
                response, retries, t_send, t_recv = await _send(
                    client, "POST", f"/v1/silos/{silo.id}/charges", stats, retry=retry, json=body, headers=silo.headers
                )
                outcome.transport_errors = retries
                outcome.status = response.status_code
                outcome.body = response.json()
                outcome.t_send, outcome.t_recv, outcome.latency = t_send, t_recv, t_recv - t_send
                outcome.answers.append((response.status_code, outcome.body.get("charge_id")))
                outcome.replayed += response.headers.get("Idempotent-Replayed") == "true"
                if response.status_code in (200, 201):  # 200: a replay of this request's own reservation
                    charge_id = outcome.body["charge_id"]
                    commit, commit_retries, c_send, c_recv = await _send(
                        client, "POST", f"/v1/charges/{charge_id}/commit", stats, retry=retry, headers=silo.headers
                    )
                    outcome.commit_status, outcome.commit_body = commit.status_code, commit.json()
                    outcome.commit_retries = commit_retries
                    stats.commit_latencies.append(c_recv - c_send)
                stats.completed += 1

    started = time.monotonic()
    tasks = [asyncio.create_task(client_loop()) for _ in range(clients)]
    watcher = asyncio.create_task(background(stats)) if background is not None else None
    try:
        await asyncio.gather(*tasks)
        if watcher is not None:
            await watcher
    finally:
        for task in [*tasks, *([watcher] if watcher else [])]:
            task.cancel()
    stats.wall_s = time.monotonic() - started
    return outcomes, stats


def percentile_ms(values: Sequence[float], p: float) -> float:
    return float(np.percentile(np.array(values), p) * 1e3)


def latency_summary(outcomes: Sequence[Outcome], stats: RunStats) -> dict[str, float]:
    approvals = [o.latency for o in outcomes]
    return {
        "wall_s": round(stats.wall_s, 2),
        "approval_requests": len(outcomes),
        "approved": sum(o.status in (200, 201) for o in outcomes),
        "refused": sum(o.status == 409 for o in outcomes),
        "http_requests": stats.http_requests,
        "requests_per_s": round(stats.http_requests / stats.wall_s, 1),
        "approval_requests_per_s": round(len(outcomes) / stats.wall_s, 1),
        "approval_p50_ms": round(percentile_ms(approvals, 50), 2),
        "approval_p99_ms": round(percentile_ms(approvals, 99), 2),
        "approval_mean_ms": round(statistics.fmean(approvals) * 1e3, 2),
        "commit_p50_ms": round(percentile_ms(stats.commit_latencies, 50), 2) if stats.commit_latencies else 0.0,
        "commit_p99_ms": round(percentile_ms(stats.commit_latencies, 99), 2) if stats.commit_latencies else 0.0,
    }


def verify_chain(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/audit/verify", headers=ADMIN, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def silo_detail(url: str, silo_id: int) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/silos/{silo_id}", headers=ADMIN, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def silo_history(url: str, silo_id: int) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/v1/silos/{silo_id}/history", headers=ADMIN, params={"limit": 100_000}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]
