"""The proven gate's ε, computed independently of the ledger from dp-accounting's own curves.

A silo publishes its filter (orders and δ shares) in GET /v1/silos/{id}; its proven ε for a history
is min over those orders of dp-accounting's RDP → (ε, δ) conversion at that order with δ·share
(compute_epsilon on one order). The curves are dp-accounting's, except that a Poisson-sampled
Gaussian's fractional orders take the certified value where it is lower, as the ledger's do: those
values are checked against a 40-digit integration in tests/service/accounting/test_fractional.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import fractional

ORDERS: list[float] = [float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS]


def filter_of(detail: Mapping[str, Any]) -> list[tuple[float, float]]:
    return list(zip(detail["filter"]["orders"], detail["filter"]["weights"], strict=True))


def sampled_gaussian_curve(q: float, sigma: float) -> np.ndarray:
    return np.array(_sampled_gaussian_curve(q, sigma))


@functools.cache
def _sampled_gaussian_curve(q: float, sigma: float) -> tuple[float, ...]:
    curve = np.array(rdp_lib._compute_rdp_poisson_subsampled_gaussian(q, sigma, ORDERS), dtype=float)
    if 0 < q < 1:
        for i, alpha in enumerate(ORDERS):
            if not alpha.is_integer():
                curve[i] = min(curve[i], fractional.rdp_upper(q=q, sigma=sigma, alpha=alpha))
    return tuple(curve.tolist())


def dpsgd_curve(runs: Iterable[tuple[float, float, int]]) -> np.ndarray:
    """Σ steps × curve(q, σ) over (q, σ, steps): composition is addition of RDP curves."""
    total = np.zeros(len(ORDERS))
    for q, sigma, steps in runs:
        total = total + steps * sampled_gaussian_curve(q, sigma)
    return total


def proven_epsilon(filter_pairs: list[tuple[float, float]], curve: np.ndarray, *, delta: float) -> float:
    return min(
        float(rdp_lib.compute_epsilon([alpha], [float(curve[ORDERS.index(alpha)])], delta * weight)[0])
        for alpha, weight in filter_pairs
    )
