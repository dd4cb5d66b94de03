"""The proven gate's ε, computed independently of the ledger from dp-accounting's own curves.

A silo publishes its filter (orders and δ shares) in GET /v1/silos/{id}; its proven ε for a history
is min over those orders of dp-accounting's RDP → (ε, δ) conversion at that order with δ·share
(compute_epsilon on one order; the product rounded one ulp down, so that the shares never sum past
δ). A Poisson-sampled Gaussian's curve is the certified upper bound at every order (never dp-accounting's
float, which can read below the exact value), checked against a 50-digit reference in
tests/service/accounting/test_soundness.py; the composition and the filter's reading are this file's
own. A silo registered without a horizon publishes its filter once its first charge fixed it
(first_charge_pairs, for before then).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import sampled_gaussian

ORDERS: list[float] = [float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS]


def filter_of(detail: Mapping[str, Any]) -> list[tuple[float, float]]:
    return list(zip(detail["filter"]["orders"], detail["filter"]["weights"], strict=True))


def sampled_gaussian_curve(q: float, sigma: float) -> np.ndarray:
    return np.array(_sampled_gaussian_curve(q, sigma))


@functools.cache
def _sampled_gaussian_curve(q: float, sigma: float) -> tuple[float, ...]:
    if not 0 < q < 1:
        return tuple(float(v) for v in rdp_lib._compute_rdp_poisson_subsampled_gaussian(q, sigma, ORDERS))
    curve, _ = sampled_gaussian.curve_upper(q=q, sigma=sigma, orders=np.array(ORDERS))
    return tuple(np.maximum(curve, 0.0).tolist())


def dpsgd_curve(runs: Iterable[tuple[float, float, int]]) -> np.ndarray:
    """Σ steps × curve(q, σ) over (q, σ, steps): composition is addition of RDP curves."""
    total = np.zeros(len(ORDERS))
    for q, sigma, steps in runs:
        total = total + steps * sampled_gaussian_curve(q, sigma)
    return total


def proven_epsilon(filter_pairs: list[tuple[float, float]], curve: np.ndarray, *, delta: float) -> float:
    return min(
        float(rdp_lib.compute_epsilon([alpha], [float(curve[ORDERS.index(alpha)])], float(np.nextafter(delta * weight, 0.0)))[0])
        for alpha, weight in filter_pairs
    )


Run = tuple[float, float, int]


def filter_pairs(silo: Any, *, first: Run | None = None) -> list[tuple[float, float]]:
    """The (order, δ share) pairs of a silo's published filter: a GET /v1/silos/{id} body, or the
    typed client's SiloDetail. A silo registered without a horizon publishes none until its first
    charge fixes it: `first` names that charge, a DP-SGD run (q, σ, steps)."""
    published = silo.get("filter") if isinstance(silo, Mapping) else silo.filter
    if published is None:
        assert first is not None, "the silo publishes no filter yet (its first charge fixes it): name that charge"
        return first_charge_pairs(silo, first)
    if isinstance(silo, Mapping):
        return filter_of(silo)
    return list(zip(silo.filter.orders, silo.filter.weights, strict=True))


def first_charge_pairs(silo: Any, first: Run) -> list[tuple[float, float]]:
    """The filter a silo with none yet will fix at a first charge of DP-SGD run `first`: the ledger's
    allocation rule (a choice of orders and shares, which the silo then publishes like any filter;
    its bound is tested in tests/service/accounting/test_filter.py), on the ledger's curve of that
    charge. Only the choice is the ledger's: every ε read through it here stays dp-accounting's."""
    from dpledger.service.accounting import filter as rdp_filter
    from dpledger.service.accounting import rdp
    from dpledger.wire.mechanisms import DpSgd

    epsilon, delta = (silo["epsilon"], silo["delta"]) if isinstance(silo, Mapping) else (silo.epsilon, silo.delta)
    q, sigma, steps = first
    curve = rdp.certified_curve(DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q))
    spec = rdp_filter.first_charge_spec(epsilon=epsilon, delta=delta, first=curve)
    return list(zip(spec.orders, spec.weights, strict=True))


def dpsgd_epsilon(silo: Any, runs: Iterable[Run], *, delta: float, first: Run | None = None) -> float:
    """The ε the gate reads for DP-SGD runs (q, σ, steps) on this silo, by dp-accounting's curves
    (`first`: its first charge, where the silo publishes no filter yet)."""
    return proven_epsilon(filter_pairs(silo, first=first), dpsgd_curve(runs), delta=delta)


def one_more_round(fits: list[Run], overflows: list[Run]) -> Run | None:
    """The round by which `overflows` exceeds `fits`, where both are one run of the same (q, σ): a job
    charged a round at a time, whose first round fixes a silo's filter where it declared no horizon."""
    if len(fits) == len(overflows) == 1 and fits[0][:2] == overflows[0][:2] and overflows[0][2] > fits[0][2]:
        return (fits[0][0], fits[0][1], overflows[0][2] - fits[0][2])
    return None


def budget_admitting(
    create: Callable[[float], Any], fits: Iterable[tuple[float, float, int]], overflows: Iterable[tuple[float, float, int]],
    *, delta: float, halvings: int = 40,
) -> Any:
    """A silo (made by `create(budget)`) whose gate admits the runs `fits` but not `overflows`.

    A silo's filter is fixed from its budget, so the budget that admits exactly a workload is a fixed
    point, and iterating it can oscillate (the committed order moves with the budget). Instead:
    bisect for the smallest budget b whose silo reads ε(fits) ≤ b, starting from the old rule's ε
    (a filter never reads less), then check that silo refuses `overflows`."""
    fits, overflows = list(fits), list(overflows)
    # A silo registered without a horizon has its filter fixed by its first charge: here, one round.
    first = one_more_round(fits, overflows)

    def admits(budget: float) -> tuple[bool, Any]:
        silo = create(budget)
        return dpsgd_epsilon(silo, fits, delta=delta, first=first) <= budget, silo

    low = float(rdp_lib.compute_epsilon(ORDERS, dpsgd_curve(fits), delta)[0])
    if low == 0:
        # Nothing to fit (no steps): any budget below the old rule's ε of `overflows` refuses it,
        # since a filter never reads less than the old rule.
        budget = float(rdp_lib.compute_epsilon(ORDERS, dpsgd_curve(overflows), delta)[0]) / 2
        silo = create(budget)
        assert dpsgd_epsilon(silo, overflows, delta=delta, first=first) > budget
        return silo
    high = 2 * low
    ok, silo = admits(high)
    while not ok:
        low, high = high, 2 * high
        ok, silo = admits(high)
    for _ in range(halvings):
        middle = (low + high) / 2
        ok, candidate = admits(middle)
        if ok:
            high, silo = middle, candidate
        else:
            low = middle
    budget = high
    assert dpsgd_epsilon(silo, overflows, delta=delta, first=first) > budget, (
        f"the smallest budget that admits {fits}, {budget!r}, admits {overflows} too"
    )
    return silo


def event_curve(event: Any) -> np.ndarray:
    """dp-accounting's RDP curve of a dp_event on the ledger's grid. For events without a
    Poisson-sampled Gaussian, which is the one kind the ledger prices tighter (dpsgd_curve)."""
    accountant = rdp_lib.RdpAccountant(ORDERS)
    accountant.compose(event)
    return np.array(accountant._rdp, dtype=float)


def probe_budget(
    fits: Iterable[tuple[float, float, int]], overflows: Iterable[tuple[float, float, int]],
    *, dataset_size: int, delta: float,
) -> float:
    """The budget at which a fresh silo of `dataset_size` records admits the DP-SGD runs `fits` but
    not `overflows`, found on a throwaway in-process ledger (a real SQLite file): for tests that must
    fix a silo's budget before the ledger they run against exists. A silo's filter is a function of
    its budget, δ and size, so the silo the test then registers with it gets the same filter."""
    from fastapi.testclient import TestClient

    from dpledger.service.api.app import create_app
    from dpledger.service.settings import Settings
    from dpledger.service.store.db import migrate
    from dpledger.wire.client import LedgerClient

    key = "gate-oracle-probe-admin-key-0123456789"
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/probe.db"
        migrate(url)
        app = create_app(Settings(database_url=url, admin_key=key))
        names = iter(range(1_000))
        try:
            with TestClient(app) as http:
                admin = LedgerClient("", key, http=http)

                def create(budget: float) -> Any:
                    made = admin.create_silo(name=f"probe-{next(names)}", epsilon=budget, delta=delta, dataset_size=dataset_size)
                    return admin.silo(made.id)

                return float(budget_admitting(create, fits, overflows, delta=delta).epsilon)
        finally:
            app.state.engine.dispose()
