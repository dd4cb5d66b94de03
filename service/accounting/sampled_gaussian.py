"""The certified RDP curve of one Poisson-sampled Gaussian step at every order of a grid, at once.

A new (q, σ) pair is priced on the approval path, so its curve is computed as a few numpy passes
over all orders instead of an order at a time (dp-accounting's loops take 40–70 ms a pair; this
takes a few ms). rdp.py keeps the lower of this and dp-accounting's value at each order, so that no
quoted ε exceeds dp-accounting's. Every value here is an upper bound on the exact divergence, rounded up:

* an integer order α is the finite sum of Mironov, Talwar & Zhang ("Rényi Differential Privacy of
  the Sampled Gaussian Mechanism", 2019, §3.3), A_α = Σ_{k≤α} C(α,k) (1−q)^{α−k} q^k e^{(k²−k)/2σ²},
  the formula dp-accounting sums too, written as A_α = 1 + Σ_{k≥2} C(α,k) (1−q)^{α−k} q^k (e^{(k²−k)/2σ²} − 1)
  (the binomial weights sum to 1, and the k = 0, 1 terms vanish), so that A_α − 1 ~ q² keeps its
  relative accuracy at a small q. Its terms are all positive: summed in log space (shifted by the
  largest), bounded above: each log-term charged 32 ulps of every component (as fractional.py
  does), the exp of each shifted term 8 ulps, the sum of n positive terms n ulps, then log1p. It
  agrees with dp-accounting's value to ~1e-13 and, unlike it, is never rounded down.
* a fractional order is fractional.py's signed series with its truncation and rounding bounds.

Where an order has no certified value here (an overflow, or a series that missed its target), the
caller keeps dp-accounting's value at that order (rdp._sampled_gaussian_cached).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from dpledger.service.accounting import fractional

_U = 2.0**-53  # unit round-off of float64
_COMPONENT_ERROR = 2.0**-48  # per log-space component, as in fractional.py


def curve_upper(*, q: float, sigma: float, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(an upper bound on the RDP at every order, whether each is certified and tight): a value
    not certified is ∞ or looser than the 1e-6 target, and the caller should not rely on it alone."""
    if not 0 < q < 1 or not sigma > 0:
        raise ValueError(f"needs 0 < q < 1 and sigma > 0; got q={q!r}, sigma={sigma!r}")
    orders = np.asarray(orders, dtype=float)
    integer = orders == np.floor(orders)
    values = np.full(orders.shape, np.inf)
    good = np.zeros(orders.shape, dtype=bool)
    if integer.any():
        values[integer] = _integer_upper(q=q, sigma=sigma, alphas=orders[integer])
        good[integer] = np.isfinite(values[integer])
    if (~integer).any():
        frac, met = fractional.rdp_upper_many(q=q, sigma=sigma, alphas=orders[~integer])
        values[~integer] = frac
        good[~integer] = met & np.isfinite(frac)
    return values, good


def _integer_upper(*, q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Upper bounds on D_α at integer orders α ≥ 2, from the finite sum above. Orders are taken in
    groups of similar size (2–63, then each of the large ones) so that no row carries ~1000 empty terms."""
    if np.any(alphas < 2):
        raise ValueError("integer orders must be at least 2")
    out = np.empty(alphas.shape)
    groups = np.where(alphas < 64, 64.0, alphas)
    for top in np.unique(groups):
        rows = groups == top
        out[rows] = _integer_rows(q=q, sigma=sigma, alphas=alphas[rows])
    return out


def _integer_rows(*, q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    top = int(alphas.max())
    k = np.arange(2, top + 1, dtype=float)[None, :]
    alpha = alphas[:, None]
    inside = k <= alpha
    j = np.where(inside, alpha - k, 0.0)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    x = (k * k - k) / (2 * sigma * sigma)
    g_a, g_k, g_j = special.gammaln(alpha + 1), special.gammaln(k + 1), special.gammaln(j + 1)
    # log C(α, k): C(α, 2) is an exact integer (its log rounded once); beyond, gammaln, charged 32 ulps
    # of each of its three parts (~6000 at α = 1024).
    two = k == 2
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_binom = np.where(two, np.log(alpha * (alpha - 1) / 2), g_a - g_k - g_j)
        binom_magnitude = np.where(two, np.abs(log_binom), np.abs(g_a) + np.abs(g_k) + np.abs(g_j))
        # log(e^x − 1), a few ulps of x either way.
        log_expm1 = np.where(x > 1, x + np.log1p(-np.exp(-x)), np.log(np.expm1(x)))
        log_t = log_binom + k * log_q + j * log_1mq + log_expm1
        magnitude = binom_magnitude + np.abs(k * log_q) + np.abs(j * log_1mq) + np.abs(log_expm1) + x
        log_t = np.where(inside, log_t, -np.inf)
        top_term = log_t.max(axis=1)
        shifted = log_t - top_term[:, None]
        # The log-term's error, plus the rounding of the shift (one ulp of its magnitude).
        eta = _COMPONENT_ERROR * (1.0 + np.where(inside, magnitude, 0.0)) + _U * np.abs(np.where(inside, shifted, 0.0))
        inflated = np.exp(shifted) * (1 + np.expm1(eta) + 8 * _U)
        total = inflated.sum(axis=1) * (1 + (top + 2) * _U)  # n positive terms: n ulps bound the summation
        # log A_α = log(1 + B), B = e^top · total; as log B + log(1 + 1/B) where B is large.
        log_a = np.where(
            top_term <= 0,
            np.log1p(np.exp(np.minimum(top_term, 0.0)) * total),
            top_term + np.log(total) + np.log1p(np.exp(-np.maximum(top_term, 0.0)) / total),
        )
        # exp, log1p and the final addition: 8 ulps of the result, up.
        log_a = np.nextafter(log_a * (1 + 8 * _U), np.inf)
        value = np.maximum(log_a, 0.0) / (alphas - 1)  # A_α ≥ 1 for α > 1 (Jensen)
    rounded: np.ndarray = np.nextafter(value * (1 + 2 * _U), np.inf)
    return rounded
