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
  itself is taken in long double and charged its worst rounding (γ_{n−1} of the terms' magnitudes).

Written here because neither dp-accounting nor Opacus offers a bounded-error fractional order.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

_U = 2.0**-53  # unit round-off of float64
_LONG_U = float(np.finfo(np.longdouble).eps) / 2  # ...and of the platform's long double (2^-64 on x86)
# Error charged to each log-space component: 32 ulps of its magnitude, plus 32 ulps absolute (scipy's
# log_ndtr and gammaln are accurate to a few ulps in absolute terms where their value is near 0).
_COMPONENT_ERROR = 2.0**-48
_START_TERMS = 64
# 4096 terms reach the target everywhere but at q near 1/2 with σ in the thousands (the ratio of the
# binomial series is then ~1 and its terms fall polynomially); there the order keeps its bound as it
# stands and the ledger takes dp-accounting's value beside it (rdp._sampled_gaussian_cached).
_MAX_TERMS = 2**12
# Stop adding terms once the truncation bound is this small relative to A_α − 1 (which is what the
# RDP is proportional to near α = 1); the rest of the 1e-6 target is headroom.
_TARGET = 1e-9
_SLACK_TARGET = 1e-7


def log_a_upper(*, q: float, sigma: float, alpha: float) -> tuple[float, bool]:
    """An upper bound on log A_α, and whether it met the relative target (else still a bound)."""
    if not 0 < q < 1 or sigma <= 0 or alpha <= 1 or float(alpha).is_integer():
        raise ValueError(f"needs 0 < q < 1, sigma > 0 and a fractional alpha > 1; got q={q!r}, sigma={sigma!r}, alpha={alpha!r}")
    values, met = log_a_upper_many(q=q, sigma=sigma, alphas=np.array([float(alpha)]))
    return float(values[0]), bool(met[0])


def rdp_upper(*, q: float, sigma: float, alpha: float) -> float:
    """A certified upper bound on D_α(P‖Q) for P = (1−q)N(0,σ²) + qN(1,σ²), Q = N(0,σ²)."""
    log_a, _ = log_a_upper(q=q, sigma=sigma, alpha=alpha)
    return float(_rdp_of(np.array([log_a]), np.array([float(alpha)]))[0])


def rdp_upper_many(*, q: float, sigma: float, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rdp_upper at every (fractional, > 1) order of `alphas` at once, and where each met the target.

    One numpy pass over all orders (the ledger's 90 fractional orders of a new (q, σ) pair in ~2 ms,
    where an order at a time took 10–70 ms); an order whose terms overflow reads ∞ (still a bound)."""
    if not 0 < q < 1 or sigma <= 0 or np.any(alphas <= 1) or np.any(alphas == np.floor(alphas)):
        raise ValueError(f"needs 0 < q < 1, sigma > 0 and fractional alphas > 1; got q={q!r}, sigma={sigma!r}")
    log_a, met = log_a_upper_many(q=q, sigma=sigma, alphas=alphas)
    return _rdp_of(log_a, alphas), met


def _rdp_of(log_a: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    # log A / (α − 1) rounded up: the division is exact-rounded, one step of 2 ulps covers it.
    value = np.maximum(log_a, 0.0) / (alphas - 1)
    rounded: np.ndarray = np.nextafter(value * (1 + 2 * _U), np.inf)
    return rounded


def log_a_upper_many(*, q: float, sigma: float, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Upper bounds on log A_α at every order of `alphas`, and whether each met the relative target.

    Orders that miss the target get twice the terms, until they meet it, or the truncation bound is
    below the rounding slack (more terms cannot make such an order tighter: at σ ~ 10^9, A_α − 1 is
    far below one ulp of 1 and the slack is the whole answer), or _MAX_TERMS is reached."""
    alphas = np.asarray(alphas, dtype=float)
    upper = np.full(alphas.shape, np.inf)
    met = np.zeros(alphas.shape, dtype=bool)
    todo = np.arange(alphas.size)
    n = _START_TERMS
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # an overflowed term gives ∞: a bound still
        while todo.size:
            terms = max(n, math.ceil(float(alphas[todo].max())) + 2)
            sum_minus_one, slack, tail = _bounded_sums(q=q, sigma=sigma, alphas=alphas[todo], terms=terms)
            upper[todo] = sum_minus_one + slack + tail
            # More terms shrink the truncation bound only; the rounding slack is what it is.
            ok = tail <= _TARGET * np.abs(sum_minus_one)
            # Met: within the target by truncation and by rounding (at q ~ 1e-5 the rounding of the
            # terms near 1 is ~1e-4 of A_α − 1 ~ q²: a bound still, but the caller takes a tighter one).
            met[todo] = ok & (slack <= _SLACK_TARGET * np.abs(sum_minus_one))
            settled = ok | (tail <= slack) | ~np.isfinite(upper[todo])
            if n >= _MAX_TERMS:
                break
            todo = todo[~settled]
            n *= 2
        # log1p is accurate to a couple of ulps: step up past them. A_α ≥ 1 for α > 1 (Jensen).
        value = np.log1p(np.maximum(np.nan_to_num(upper, nan=np.inf), 0.0))
    return np.nextafter(value * (1 + 4 * _U), np.inf), met


def _bounded_sums(*, q: float, sigma: float, alphas: np.ndarray, terms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per order: (Σ_{k≤K} t_k − 1, a bound on its rounding error, a bound on the positive part of the
    tails) over both halves, with K = terms − 1; the terms K+1 give the Leibniz tail bound. Rows are
    orders, columns k."""
    k = np.arange(terms + 1, dtype=float)[None, :]
    alpha = alphas[:, None]
    j = alpha - k
    s2 = 2 * sigma * sigma
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = sigma * sigma * (math.log1p(-q) - log_q) + 0.5
    gamma_alpha = special.gammaln(alpha + 1)
    g_k, g_j = special.gammaln(k + 1), special.gammaln(j + 1)  # gammaln is log|Γ|
    log_binom = gamma_alpha - g_k - g_j
    negative_factors = np.maximum(0.0, k - np.ceil(alpha))
    sign = np.where(negative_factors % 2 == 0, 1.0, -1.0)
    mag_binom = np.abs(gamma_alpha) + np.abs(g_k) + np.abs(g_j)

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

    rows = alphas.size
    kept: list[np.ndarray] = []
    slack = np.zeros(rows)
    tail = np.zeros(rows)
    for log_t, magnitude in halves:
        t = sign * np.exp(log_t)
        eta = _COMPONENT_ERROR * (1.0 + magnitude)
        # A term exp() flushed to 0 is covered below (1e-300 each); its own error is then 0, not 0·∞.
        error = np.where(t == 0, 0.0, np.abs(t) * (np.expm1(eta) + 4 * _U))
        kept.append(t[:, :-1])
        slack += error[:, :-1].sum(axis=1) * (1 + terms * 2 * _U)  # a sum of positives: its rounding, bounded
        # The first omitted term (k = K+1 > α) bounds its tail; only a positive tail raises the sum.
        tail += np.maximum(0.0, t[:, -1]) + error[:, -1]
    # The signed sum, its terms cancelling, in the platform's long double (64-bit significand on x86,
    # where math.fsum an order at a time cost ~0.5 ms of a new pair's ~2.4): any order of n additions
    # errs by at most γ_{n−1}·Σ|t| (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2),
    # charged below, ~1e-17 absolute beside the terms' own ~1e-13; a platform whose long double is
    # a double charges ~3e-14, still a bound (the chord and moment bounds are tighter there anyway).
    parts = np.concatenate([np.full((rows, 1), -1.0), *kept], axis=1)
    count = parts.shape[1]
    total = parts.astype(np.longdouble).sum(axis=1).astype(float)
    summed = _LONG_U * (count - 1) / (1 - _LONG_U * (count - 1)) * np.abs(parts).sum(axis=1) * (1 + count * 2 * _U)
    # The rounded sum (to long double, then to a double), and terms exp() flushed to 0; the slack and
    # tail sums are rounded up by a hair.
    slack = slack + summed + 2 * _U * np.abs(total) + count * 1e-300
    return total, slack * (1 + 4 * _U), tail * (1 + 4 * _U)
