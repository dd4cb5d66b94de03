"""What an operator watches: Prometheus metrics at `/metrics`, and one access-log line per request.

One ASGI middleware times every request and labels it by route template (never the raw path, whose
ids would make one time series per silo). Charge decisions are noted by the route that makes them
(`note_decision`); requests that fail before a decision are classified here by status code.

Counters live in a registry of the app's own, so that tests building many apps do not collide. With
`PROMETHEUS_MULTIPROC_DIR` set, prometheus_client keeps values in files there and `/metrics` sums
every worker process's; without it each process reports only its own.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpledger.service.api.deps import DbDep, Principal
from dpledger.service.ledger import keys, silos
from dpledger.service.store.db import Database
from dpledger.service.store.models import Role

RESERVE_ROUTE = "reserve_charge"
DECISIONS = "dpledger_charge_decisions"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
UNMATCHED = "<unmatched>"
# Approvals take milliseconds (a cached (q, σ)) to tens of milliseconds (a new one): finer low buckets.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The API's own classes of a failed charge request (see service/api/errors.py).
ERROR_REASONS = {401: "unauthorized", 403: "forbidden", 404: "not_found", 409: "conflict", 422: "invalid_request"}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

access_log = logging.getLogger("dpledger.access")
ledger_log = logging.getLogger("dpledger.ledger")


@dataclass(frozen=True)
class Decision:
    outcome: Literal["approved", "refused"]
    reason: str  # approved: "reserved" or "replayed" (an idempotent retry); refused: "over_budget"
    silo_id: int
    charge_id: int | None
    epsilon_spent: float  # after the decision: what a refusal left unchanged
    epsilon_if_approved: float | None = None


def note_decision(request: Request, decision: Decision) -> None:
    """Called by the route that decided: logs the decision and leaves it for the middleware to count."""
    request.state.decision = decision
    ledger_log.info("charge %s", decision.outcome, extra={"fields": {"event": "charge_decision", **asdict(decision)}})


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        self.decisions = Counter(
            DECISIONS, "Charge requests by outcome (approved, refused, error) and reason",
            ["outcome", "reason"], registry=self.registry,
        )
        self.latency = Histogram(
            "dpledger_http_request_duration_seconds", "HTTP request latency by route template, method and status class",
            ["route", "method", "status_class"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        # Present at zero from the start, so a rate() over a fresh process is 0 rather than absent.
        for outcome, reason in (("approved", "reserved"), ("approved", "replayed"), ("refused", "over_budget")):
            self.decisions.labels(outcome, reason)

    def service_exposition(self, *, with_decisions: bool) -> bytes:
        """Every metric, or (`with_decisions=False`) all but the charge decisions: how often silos
        are refused over budget is budget information, for the admin only."""
        source: CollectorRegistry = self.registry
        if self.multiprocess_dir is not None:
            source = CollectorRegistry()
            multiprocess.MultiProcessCollector(source, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]  # unannotated upstream
        if with_decisions:
            return generate_latest(source)
        return generate_latest(_Without(source, DECISIONS))  # duck-typed: generate_latest only calls collect()


class _Without:
    """A registry's metrics but one family."""

    def __init__(self, source: CollectorRegistry, name: str) -> None:
        self.source, self.name = source, name

    def collect(self) -> Iterator[Any]:
        return (family for family in self.source.collect() if family.name != self.name)


class SiloBudgets(Collector):
    """ε spent and budget per silo, read from the database at scrape time: the database is the one
    truth shared by every worker, so these need no multiprocess bookkeeping."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        spent = GaugeMetricFamily("dpledger_silo_epsilon_spent", "ε spent (reserved + committed) per silo", labels=["silo_id"])
        budget = GaugeMetricFamily("dpledger_silo_epsilon_budget", "ε budget per silo", labels=["silo_id"])
        with self.db.read() as session:
            for silo in silos.list_all(session):
                spent.add_metric([str(silo.id)], silos.epsilon_spent(silo))
                budget.add_metric([str(silo.id)], silo.epsilon)
        yield spent
        yield budget


def _status_class(status: int) -> str:
    return f"{status // 100}xx"


def _request_id(scope: Scope) -> str:
    # A balancer's id is kept so lines correlate across hops; anything odd is replaced, not echoed.
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            candidate: str = value.decode("latin-1")  # ASGI headers are bytes pairs; the scope is untyped
            if _REQUEST_ID.fullmatch(candidate):
                return candidate
    return uuid.uuid4().hex


class ObserveRequests:
    """Times each HTTP request, counts charge outcomes, writes the access line."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state: dict[str, Any] = scope.setdefault("state", {})  # shared with the route's request.state
        request_id = _request_id(scope)
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, state, request_id=request_id, status=status, seconds=time.perf_counter() - started)

    def _record(self, scope: Scope, state: dict[str, Any], *, request_id: str, status: int, seconds: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", UNMATCHED)
        method = str(scope["method"])
        self.metrics.latency.labels(template, method, _status_class(status)).observe(seconds)

        fields: dict[str, Any] = {
            "method": method, "route": template, "status": status, "duration_ms": round(seconds * 1000, 3),
            "request_id": request_id,
        }
        principal = state.get("principal")
        if isinstance(principal, Principal):
            fields.update(role=principal.role.value, key_id=principal.key_id)
        if getattr(route, "name", None) == RESERVE_ROUTE:
            decision = state.get("decision")
            outcome: str
            if isinstance(decision, Decision):
                outcome, reason = decision.outcome, decision.reason
                fields.update(charge_id=decision.charge_id, epsilon_spent=decision.epsilon_spent)
            else:
                outcome, reason = "error", ERROR_REASONS.get(status, "internal" if status >= 500 else f"http_{status}")
            self.metrics.decisions.labels(outcome, reason).inc()
            raw_id = str(scope.get("path_params", {}).get("silo_id", ""))
            fields.update(silo_id=int(raw_id) if raw_id.isdigit() else None, outcome=outcome, reason=reason)
        access_log.info("%s %s %d", method, template, status, extra={"fields": fields})


_optional_bearer = HTTPBearer(auto_error=False)
router = APIRouter()


@router.get("/metrics", include_in_schema=False, name="metrics")
def scrape(
    request: Request, db: DbDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_optional_bearer)]
) -> Response:
    """Service metrics (latency) for anyone who can reach the port; the charge decisions by outcome
    and per-silo ε only with the admin key, since budgets are kept from other silos and the
    coordinator (docs/ARCHITECTURE.md, "Roles")."""
    key = None
    if credentials is not None:
        with db.read() as session:
            key = keys.authenticate(session, credentials.credentials)
    if key is not None:
        request.state.principal = Principal(key_id=key.id, role=Role(key.role), silo_id=key.silo_id)
    admin = key is not None and Role(key.role) is Role.admin
    body: bytes = request.app.state.metrics.service_exposition(with_decisions=admin)
    if admin:
        body += generate_latest(SiloBudgets(db))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def install(app: FastAPI) -> None:
    app.state.metrics = Metrics()
    app.add_middleware(ObserveRequests, metrics=app.state.metrics)
    app.include_router(router)
