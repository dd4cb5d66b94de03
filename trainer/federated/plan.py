"""A round's dataset queries, declared once and metered once.

Every federated algorithm answers two questions per round from one `RoundPlan`: what each silo asks
the ledger to approve (`mechanisms`), and what its round may query once approved (`expected`). While
the round runs, each query of a silo's data is recorded in a `QueryMeter` at the one place that
makes it (a DP-SGD step, a cluster selection, a quantile query); after the round, `RoundPlan.check`
compares what ran with what was planned, query kind by query kind. A mismatch is a bug in this
package, never user error, and fails the round before its result reaches the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpledger.wire.mechanisms import AnyMechanism, Composed

# The query kinds, named as the failure message counts them ("Round 3: selections run [...]").
STEPS = "steps"  # Poisson-sampled Gaussian DP-SGD steps
SELECTIONS = "selections"  # IFCA's private cluster selection
QUANTILE_QUERIES = "quantile queries"  # FedHDP's noisy count of unclipped updates

Mechanism = AnyMechanism  # the ledger's wire models (dpledger.wire), as the samplers and queries produce them


@dataclass(frozen=True)
class PlannedQuery:
    """`count` queries of one kind on a silo's data, which together are the mechanism `mechanism`."""

    kind: str
    count: int
    mechanism: Mechanism


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """Per silo, the queries round `round_index` makes of its data if approved (empty: none).

    A pure function of the round index and the seed (never of what was approved), so the plan the
    ledger approved and the plan the round is checked against are the same object."""

    round_index: int
    queries: tuple[tuple[PlannedQuery, ...], ...]

    @property
    def num_silos(self) -> int:
        return len(self.queries)

    def mechanisms(self) -> list[Mechanism | None]:
        """What each silo asks the ledger to approve: its one query's mechanism, the composition of
        several, or None where the round queries nothing of it. The wire models are frozen, so the
        plan stays as approved whatever a caller does with them."""
        out: list[Mechanism | None] = []
        for planned in self.queries:
            if not planned:
                out.append(None)
            elif len(planned) == 1:
                out.append(planned[0].mechanism)
            else:
                out.append(Composed(events=[q.mechanism for q in planned]))
        return out

    def queries_data(self) -> torch.Tensor:
        """bool [K]: the silos this round would query at all."""
        return torch.tensor([bool(planned) for planned in self.queries], dtype=torch.bool)

    def expected(self, active: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per query kind, int64 [K]: how many queries each silo in `active` (bool [K]) must run; 0 elsewhere."""
        counts: dict[str, torch.Tensor] = {}
        for k, planned in enumerate(self.queries):
            for query in planned:
                counts.setdefault(query.kind, torch.zeros(self.num_silos, dtype=torch.int64))
                if bool(active[k]):
                    counts[query.kind][k] += query.count
        return counts

    def check(self, active: torch.Tensor, ran: Metered) -> None:
        """Privacy-critical invariant: each silo in `active` ran exactly the queries planned for it,
        each of the mechanism planned, and no other silo touched its data."""
        expected = self.expected(active)
        for kind in sorted(expected.keys() | ran.counts.keys()):
            zeros = torch.zeros(self.num_silos, dtype=torch.int64)
            made, planned = ran.counts.get(kind, zeros), expected.get(kind, zeros)
            if not torch.equal(made, planned):
                raise RuntimeError(f"Round {self.round_index}: {kind} run {made.tolist()} != approved {planned.tolist()}.")
        for (kind, k), mechanism in sorted(ran.mechanisms.items()):
            declared = next(q.mechanism for q in self.queries[k] if q.kind == kind)
            if mechanism != declared:
                raise RuntimeError(f"Round {self.round_index}: silo {k}'s {kind} ran {mechanism}, declared {declared}.")


@dataclass(frozen=True, kw_only=True)
class Metered:
    """What one round ran: per query kind, int64 [K] counts, and the mechanism of every query that
    reported its own (keyed by kind and silo)."""

    counts: dict[str, torch.Tensor]
    mechanisms: dict[tuple[str, int], Mechanism]


class QueryMeter:
    """Counts every query of every silo's data, per kind: in total, and since `start()`."""

    def __init__(self, num_silos: int) -> None:
        self.num_silos = num_silos
        self._totals: dict[str, torch.Tensor] = {}
        self._at_start: dict[str, torch.Tensor] = {}
        self._mechanisms: dict[tuple[str, int], Mechanism] = {}

    def total(self, kind: str) -> torch.Tensor:
        """int64 [K] (CPU): the queries of `kind` each silo has run so far (a live view)."""
        return self._totals.setdefault(kind, torch.zeros(self.num_silos, dtype=torch.int64))

    def record(self, kind: str, silos: torch.Tensor, *, mechanism: Mechanism | None = None) -> None:
        """One query of `kind` on the data of each silo in `silos` (int64 [A], distinct, any device);
        with `mechanism`, the query reports what it ran, and the check compares it too."""
        self.total(kind)[silos.cpu()] += 1
        if mechanism is not None:
            for k in silos.tolist():
                self._mechanisms[(kind, int(k))] = mechanism

    def start(self) -> None:
        self._at_start = {kind: counts.clone() for kind, counts in self._totals.items()}
        self._mechanisms = {}

    def since_start(self) -> Metered:
        zeros = torch.zeros(self.num_silos, dtype=torch.int64)
        counts = {kind: total - self._at_start.get(kind, zeros) for kind, total in self._totals.items()}
        return Metered(counts=counts, mechanisms=dict(self._mechanisms))

