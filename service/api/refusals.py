"""Refusals seen by this server process, per silo, for the dashboard.

A refusal writes nothing to the database (the safety invariant: a 409 leaves the ledger as it was),
so the ledger's history has no row to count. This keeps a count per silo and the latest refusal's
numbers in memory from the process's start; with several workers each counts the requests it
answered (`dpledger_charge_decisions_total{outcome="refused"}` sums them for Prometheus). A durable
record would need a table of its own: a schema change this module deliberately does not make.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime


@dataclass(frozen=True)
class Refusal:
    at: datetime
    job_id: str | None
    round: int | None
    epsilon_spent: float
    epsilon_if_approved: float


@dataclass(frozen=True)
class SiloRefusals:
    count: int
    last: Refusal


class RefusalLog:
    def __init__(self) -> None:
        self.since = datetime.now(UTC)
        self._lock = threading.Lock()
        self._by_silo: dict[int, SiloRefusals] = {}

    def record(self, silo_id: int, refusal: Refusal) -> None:
        with self._lock:
            earlier = self._by_silo.get(silo_id)
            self._by_silo[silo_id] = SiloRefusals(count=1 + (earlier.count if earlier else 0), last=refusal)

    def of(self, silo_id: int) -> SiloRefusals | None:
        with self._lock:
            return self._by_silo.get(silo_id)
