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
        alphas = orders[~integer]
        frac, met = fractional.rdp_upper_many(q=q, sigma=sigma, alphas=alphas)
        other = np.fmin(_chord_upper(q=q, sigma=sigma, alphas=alphas), _moment_upper(q=q, sigma=sigma, alphas=alphas))
        values[~integer] = np.fmin(frac, other)
        good[~integer] = (met & np.isfinite(frac)) | (other <= frac)
    return values, good


def _chord_upper(*, q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Upper bounds on D_α at fractional orders from the certified integer ones beside them.

    log A_α is convex in α (a log moment-generating function of the privacy loss), so on [n, n + 1]
    it lies below its chord: log A_α ≤ (n + 1 − α)·log A_n + (α − n)·log A_{n+1}, with log A_1 = 0.
    Both ends are certified upper bounds (_integer_upper), so the chord is one too. Where A_α − 1 is
    far below the rounding of the fractional series' terms near 1 (q ≲ 1e-5 with a large σ), the
    series can only state a bound many times the truth, and the chord is within a fraction of a
    percent of it (log A_α ≈ C(α, 2)·c·q² there, whose chord is off by (α − n)(n + 1 − α)/2 over C(α, 2))."""
    low = np.floor(alphas)
    ends = np.unique(np.concatenate([low, low + 1]))
    ends = ends[ends >= 2]
    log_a = {1.0: 0.0}
    if ends.size:
        log_a.update(zip(ends.tolist(), (_integer_upper(q=q, sigma=sigma, alphas=ends) * (ends - 1)).tolist(), strict=True))
    lo = np.array([log_a[a] for a in low.tolist()])
    hi = np.array([log_a[a + 1] for a in low.tolist()])
    t = alphas - low
    with np.errstate(invalid="ignore", over="ignore"):
        # Two products and a sum of non-negatives, each rounded up by the 8 ulps added.
        chord = ((1 - t) * lo + t * hi) * (1 + 8 * _U)
        value = chord / (alphas - 1) * (1 + 4 * _U)
        bounded: np.ndarray = np.nextafter(np.nan_to_num(value, nan=np.inf), np.inf)
    return bounded


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


# The moment bound's Taylor degrees: p − 1 for each p = n + 2, n + 4, … up to n + 2·_MOMENT_DEPTH.
_MOMENT_DEPTH = 4


def _moment_upper(*, q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Upper bounds on D_α at fractional orders from the moments of the privacy ratio, tight at small q.

    With Y = e^{(2z − 1)/2σ²}, z ~ N(0, σ²), and x = q(Y − 1): A_α = E[(1 + x)^α], E[x] = 0 and
    E[(Y − 1)^k] = Σ_j C(k, j)(−1)^{k−j} e^{j(j−1)/2σ²} =: M_k in closed form. Taylor's theorem with
    Lagrange's remainder: (1 + x)^α = Σ_{k<p} C(α, k) x^k + C(α, p)(1 + ξ)^{α−p} x^p, ξ between 0 and x.
    Past n = ⌊α⌋ the signs of C(α, k) alternate, negative at k = n + 2, n + 4, …; at such a p the
    remainder is ≤ 0 wherever x^p ≥ 0: for every x when n is even (p even), for x ≥ 0 when n is odd,
    where on x ∈ (−q, 0) it is at most |C(α, p)|(1 − q)^{α−p} q^p min(1, w)^p with w = (1 − 2z)/2σ²
    ~ N(1/2σ², 1/σ²) (1 − e^{−w} ≤ min(1, w)), whose p-th moment is at most its (p + 1)-th to the
    power p/(p + 1). So A_α − 1 ≤ Σ_{2≤k<p} C(α, k) q^k M_k (+ that term for odd n), each rounding
    charged. The fractional series' terms near 1 carry rounding of ~1e-16, so where A_α − 1 ~ q²/σ² is
    small (q ≲ 1e-3) that series states a bound 1e-7 … 100× above the truth; this one is within
    rounding of the truth there. The least of p = n + 2, n + 4, … is kept."""
    n = np.floor(alphas)
    top = int(n.max()) + 2 * _MOMENT_DEPTH + 1
    ks = np.arange(top + 1)
    with np.errstate(over="ignore", invalid="ignore"):
        # E[Y^j] − 1 = expm1(j(j − 1)/2σ²); M_k from them, as Σ_j C(k, j)(−1)^{k−j} = 0 for k ≥ 1.
        e = np.expm1(ks * (ks - 1) / (2 * sigma * sigma))
        binom = special.comb(ks[:, None], ks[None, :], exact=False)  # exact integers for k ≤ 60
        signs = np.where((ks[:, None] - ks[None, :]) % 2 == 0, 1.0, -1.0)
        mask = ks[None, :] <= ks[:, None]
        m_terms = np.where(mask, binom * signs * e[None, :], 0.0)
        moment = m_terms.sum(axis=1)
        moment[2] = e[2]  # M_2 = e^{1/σ²} − 1 exactly (one expm1)
        # Each expm1 within 2 ulps, a binomial ≤ 2^60 exact, the products and the sum: (k + 4)·4 ulps of Σ|terms|.
        m_error = np.abs(m_terms).sum(axis=1) * (ks + 4) * 4 * _U
        m_error[2] = abs(e[2]) * 4 * _U
        # C(α, k) = Π_{i<k} (α − i)/(i + 1), rows α, columns k; 3 ulps a factor.
        factors = (alphas[:, None] - ks[None, :-1]) / (ks[None, :-1] + 1)
        c_alpha = np.concatenate([np.ones((alphas.size, 1)), np.cumprod(factors, axis=1)], axis=1)
        c_error = np.abs(c_alpha) * 3 * (ks[None, :] + 1) * _U
        q_pow = q ** ks.astype(float)
        q_error = q_pow * (ks + 2) * _U
        terms = c_alpha * q_pow[None, :] * moment[None, :]
        terms[:, :2] = 0.0  # k = 0 and k = 1 cancel exactly against the 1 and E[x] = 0
        size = np.abs(moment)[None, :]
        errors = (c_error * q_pow[None, :] * size + np.abs(c_alpha) * q_error[None, :] * size
                  + np.abs(c_alpha) * q_pow[None, :] * m_error[None, :])
        errors[:, :2] = 0.0
        mu, s2 = 1 / (2 * sigma * sigma), 1 / (sigma * sigma)
        best = np.full(alphas.shape, np.inf)
        for step in range(1, _MOMENT_DEPTH + 1):
            p = (n + 2 * step).astype(int)
            kept = ks[None, :] < p[:, None]
            total = np.where(kept, terms, 0.0).sum(axis=1)
            error = np.where(kept, errors, 0.0).sum(axis=1) + np.abs(np.where(kept, terms, 0.0)).sum(axis=1) * (top + 2) * _U
            rows = np.arange(alphas.size)
            odd = n % 2 == 1
            # n odd: the remainder on x < 0, |C(α, p)| (1 − q)^{α−p} q^p E[min(1, w)^p].
            powers = {k: _even_normal_moment(mu, s2, k + 1) ** (k / (k + 1)) for k in set(p.tolist())}
            w_moment = np.array([powers[k] for k in p.tolist()])
            tail = np.abs(c_alpha[rows, p]) * (1 - q) ** (alphas - p) * q_pow[p] * np.minimum(1.0, w_moment)
            total = total + np.where(odd, tail * (1 + 64 * _U), 0.0)
            upper = (total + error) * (1 + 4 * _U)
            best = np.fmin(best, np.where(np.isfinite(upper), upper, np.inf))
        log_a = np.nextafter(np.log1p(np.maximum(best, 0.0)) * (1 + 4 * _U), np.inf)
        value = log_a / (alphas - 1) * (1 + 2 * _U)
        bounded: np.ndarray = np.nextafter(np.nan_to_num(value, nan=np.inf), np.inf)
    return bounded


def _even_normal_moment(mu: float, variance: float, power: int) -> float:
    """E[w^power] for w ~ N(mu, variance) and an even power: Σ_i C(power, 2i) mu^{power−2i} variance^i (2i − 1)!!,
    a sum of non-negative terms, rounded up by a margin far above its rounding."""
    total = 0.0
    double_factorial = 1.0
    for i in range(power // 2 + 1):
        if i > 0:
            double_factorial *= 2 * i - 1
        total += math.comb(power, 2 * i) * mu ** (power - 2 * i) * variance**i * double_factorial
    return total * (1 + 64 * _U)
