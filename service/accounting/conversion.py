"""The RDP → (ε, δ) conversion the ledger states, read on its safe side.

dp-accounting's compute_epsilon (Canonne, Kamath & Steinke 2020, Proposition 12, with its KL branch)
in float arithmetic can read a hair below the exact conversion of the value it is given: an ulp in
the sum, or a value within rounding of the KL threshold read as ε = 0 where the exact one is far
above. Every ε the ledger states is this conversion instead: the same branches, the sum moved up
past its roundings and the KL branch taken only where it clears them. dp-accounting's own function
stays the reference (rdp.epsilon); the two differ by ~1e-15 relative away from the threshold.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

_U = 2.0**-53  # unit round-off of float64


def order_epsilon(*, order: float, rdp_value: float, delta: float) -> float:
    """dp-accounting's RDP → (ε, δ) conversion at one order (the one its compute_epsilon minimises)."""
    if math.isnan(rdp_value) or math.isinf(rdp_value):
        return math.inf
    return float(rdp_lib.compute_epsilon([order], [rdp_value], delta)[0])


def order_epsilons(orders: np.ndarray, rdp_values: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """order_epsilon at many orders at once: the same branches as dp-accounting's compute_epsilon
    (Canonne, Kamath & Steinke 2020, Proposition 12), vectorised because one call per order costs
    ~20 µs of Python and a legacy filter has 156 orders. Checked against it in the tests."""
    return epsilons(order_terms(orders, deltas), rdp_values)


Terms = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def order_terms(orders: np.ndarray, deltas: np.ndarray) -> Terms:
    """What order_epsilons computes from the orders and δs alone: fixed for a silo's filter."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return orders > 1.01, np.log1p(-1 / orders), np.log(deltas * orders) / (orders - 1), deltas**2


def epsilons(terms: Terms, rdp_values: np.ndarray) -> np.ndarray:
    above, log_term, delta_term, squared = terms
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        eps = rdp_values + log_term - delta_term
        # dp-accounting's branches, each read on its safe side: the sum moved up past its three
        # roundings (and those of the log terms, a few ulps each), so the stated ε is never below
        # the exact conversion of the exact sum; the KL branch taken only where δ² clears
        # 1 − e^{−KL} by more than their rounding, so that a sum within rounding of the threshold is
        # read above it (ε > 0), never as ε = 0.
        slack = (np.abs(rdp_values) + np.abs(log_term) + np.abs(delta_term)) * (8 * _U)
        eps = np.where(above, np.nextafter(eps + slack, np.inf), np.inf)
        eps = np.where(squared * (1 - 32 * _U) + np.expm1(-rdp_values) > 0, 0.0, eps)  # the KL bound: δ ≥ sqrt(1 − e^{−KL})
        eps = np.where(rdp_values < 0, 0.0, eps)
        eps = np.where(np.isfinite(rdp_values), eps, np.inf)
    read: np.ndarray = np.maximum(eps, 0.0)
    return read


