"""Certified upper bounds on the RDP of the Poisson-subsampled Gaussian at fractional orders.

dp-accounting computes the integer orders exactly, and we keep those. At a fractional order α it
sums the *absolute values* of the series of Mironov, Talwar & Zhang ("Rényi Differential Privacy of
the Sampled Gaussian Mechanism", 2019, §3.3), which over-states the divergence by 2–35% on (1, 2);
the signed series (Opacus) is exact in the limit but, summed in floating point with no error bound,
falls below the true value about half of the time. Here the signed series is summed with two
bounds added, so the result is an upper bound:

* truncation. A_α = E_{z~N(0,σ²)}[(1 − q + q·e^{(2z−1)/2σ²})^α] splits at z0 (where the two
  summands are equal) into two binomial series in a ratio r ∈ [0, 1]. For k > α the coefficients
  C(α, k) alternate in sign and shrink in magnitude, and E[r^k] shrinks with k, so each tail is an
  alternating series with decreasing terms (Leibniz): it has the sign of its first term and is at
  most that term in magnitude. We add that first term when it is positive.
* rounding. Each term is exp of a sum of a few logs; we charge it a relative error of 2^-48 times
  (1 + the sum of the magnitudes of those logs), i.e. 32 ulps of every component and 32 ulps
  absolute, well above the few-ulp accuracy of numpy's log/exp and scipy's gammaln/log_ndtr; the sum
  itself is exact-rounded (math.fsum).

Written here because neither dp-accounting nor Opacus offers a bounded-error fractional order.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

_U = 2.0**-53  # unit round-off of float64
# Error charged to each log-space component: 32 ulps of its magnitude, plus 32 ulps absolute (scipy's
# log_ndtr and gammaln are accurate to a few ulps in absolute terms where their value is near 0).
_COMPONENT_ERROR = 2.0**-48
_START_TERMS = 64
_MAX_TERMS = 2**16
# Stop adding terms once the truncation bound is this small relative to A_α − 1 (which is what the
# RDP is proportional to near α = 1); the rest of the 1e-6 target is headroom.
_TARGET = 1e-9


def log_a_upper(*, q: float, sigma: float, alpha: float) -> tuple[float, bool]:
    """An upper bound on log A_α, and whether it met the relative target (else still a bound)."""
    if not 0 < q < 1 or sigma <= 0 or alpha <= 1 or float(alpha).is_integer():
        raise ValueError(f"needs 0 < q < 1, sigma > 0 and a fractional alpha > 1; got q={q!r}, sigma={sigma!r}, alpha={alpha!r}")
    n = _START_TERMS
    while True:
        sum_minus_one, slack, tail = _bounded_sum(q=q, sigma=sigma, alpha=alpha, terms=max(n, math.ceil(alpha) + 2))
        upper = sum_minus_one + slack + tail
        # More terms shrink the truncation bound only; the rounding slack is what it is.
        met = tail <= _TARGET * abs(sum_minus_one)
        if met or n >= _MAX_TERMS:
            break
        n *= 2
    # log1p is accurate to a couple of ulps: step up past them.
    value = math.log1p(max(upper, 0.0))  # A_α ≥ 1 for α > 1 (Jensen)
    return math.nextafter(value * (1 + 4 * _U), math.inf), met


def rdp_upper(*, q: float, sigma: float, alpha: float) -> float:
    """A certified upper bound on D_α(P‖Q) for P = (1−q)N(0,σ²) + qN(1,σ²), Q = N(0,σ²)."""
    log_a, _ = log_a_upper(q=q, sigma=sigma, alpha=alpha)
    value = max(log_a, 0.0) / (alpha - 1)
    return math.nextafter(value * (1 + 2 * _U), math.inf)


def _bounded_sum(*, q: float, sigma: float, alpha: float, terms: int) -> tuple[float, float, float]:
    """(Σ_{k≤K} t_k − 1, a bound on its rounding error, a bound on the positive part of the tails)
    over both halves, with K = terms − 1; the terms K+1 give the Leibniz tail bound."""
    k = np.arange(terms + 1, dtype=float)
    j = alpha - k
    s2 = 2 * sigma * sigma
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = sigma * sigma * (math.log1p(-q) - log_q) + 0.5
    gamma_alpha = special.gammaln(alpha + 1)
    g_k, g_j = special.gammaln(k + 1), special.gammaln(j + 1)  # gammaln is log|Γ|
    log_binom = gamma_alpha - g_k - g_j
    negative_factors = np.maximum(0.0, k - math.ceil(alpha))
    sign = np.where(negative_factors % 2 == 0, 1.0, -1.0)
    mag_binom = abs(gamma_alpha) + np.abs(g_k) + np.abs(g_j)

    halves = []
    # z ≤ z0: (1−q)^{α−k} q^k E[e^{k(2z−1)/2σ²}; z ≤ z0] = ... · e^{(k²−k)/2σ²} Φ((z0−k)/σ)
    lower_cdf = special.log_ndtr((z0 - k) / sigma)
    halves.append((
        log_binom + k * log_q + j * log_1mq + (k * k - k) / s2 + lower_cdf,
        mag_binom + np.abs(k * log_q) + np.abs(j * log_1mq) + (k * k + k) / s2 + np.abs(lower_cdf),
    ))
    # z > z0: (1−q)^k q^{α−k} E[e^{(α−k)(2z−1)/2σ²}; z > z0] = ... · e^{(j²−j)/2σ²} Φ((j−z0)/σ)
    upper_cdf = special.log_ndtr((j - z0) / sigma)
    halves.append((
        log_binom + j * log_q + k * log_1mq + (j * j - j) / s2 + upper_cdf,
        mag_binom + np.abs(j * log_q) + np.abs(k * log_1mq) + (j * j + np.abs(j)) / s2 + np.abs(upper_cdf),
    ))

    parts: list[float] = [-1.0]
    slack = 0.0
    tail = 0.0
    for log_t, magnitude in halves:
        t = sign * np.exp(log_t)
        eta = _COMPONENT_ERROR * (1.0 + magnitude)
        error = np.abs(t) * (np.expm1(eta) + 4 * _U)
        parts.extend(t[:-1].tolist())
        slack += math.fsum(error[:-1].tolist())
        # The first omitted term (k = K+1 > α) bounds its tail; only a positive tail raises the sum.
        tail += max(0.0, float(t[-1])) + float(error[-1])
    total = math.fsum(parts)
    slack += 2 * _U * abs(total) + len(parts) * 1e-300  # the rounded sum, and terms exp() flushed to 0
    return total, slack, tail
