"""dp-accounting's RDP of one Poisson-sampled Gaussian step, to the bit, in a fraction of its time.

The ledger charges the lower of its certified curve and dp-accounting's at every order (rdp.py), so
a new (q, σ) pair needs dp-accounting's own values. dp-accounting (`rdp_privacy_accountant`,
`_compute_log_a_int` / `_compute_log_a_frac`, the series of Mironov, Talwar & Zhang, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism", 2019, §3.3) computes them one term at a
time in Python, three scalar gammaln and two log_ndtr calls per term: 40–70 ms a pair. Written here
because nothing else gives those exact values faster: the same operations in the same order, with
the per-term arithmetic done by numpy over all terms (IEEE +, −, ×, ÷ and the same scipy functions,
elementwise, round the same as one at a time) and only the order-dependent log-space running sums
left as a Python loop, with the `math` functions dp-accounting calls.

Equality is not assumed: `curve` checks itself against dp-accounting on a few pairs the first time
it runs in a process and, should they ever differ (a dp-accounting release that changed its sums),
returns dp-accounting's own values from then on. tests/service/accounting/test_reference_curve.py
holds it equal, to the bit, over a spread of pairs.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import numpy as np
from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import special

_log = logging.getLogger(__name__)

# Where the replica runs: σ² neither overflows nor underflows, and the sums keep to finite terms.
# Outside it, dp-accounting's own loops answer (rare pairs; the ledger's noise floor sits inside).
_SIGMA_RANGE = (1e-6, 1e8)
# dp-accounting's cap on the terms of a fractional order (_MAX_STEPS_LOG_A_FRAC).
_MAX_FRACTIONAL_TERMS = 1000
_FIRST_CHUNK = 64
# Pairs the self-check compares: a typical DP-SGD step, a tiny rate, a wide one with large noise.
_SELF_CHECK_PAIRS = ((0.01, 1.1), (1e-4, 0.7), (0.3, 8.0))


def curve(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """dp-accounting's `RdpAccountant(orders)` after one `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`,
    its `.rdp`, for 0 < q < 1 and σ > 0."""
    if not 0 < q < 1 or not sigma > 0:
        raise ValueError(f"needs 0 < q < 1 and sigma > 0; got q={q!r}, sigma={sigma!r}")
    if not _SIGMA_RANGE[0] <= sigma <= _SIGMA_RANGE[1] or not _agrees():
        return _dp_accounting(q, sigma, orders)
    return _replica(q, sigma, orders)


def _dp_accounting(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    accountant = rdp_lib.RdpAccountant(list(orders))
    accountant.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)))
    return np.array(accountant.rdp, dtype=float)


@functools.cache
def _agrees() -> bool:
    orders = [float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS]
    for q, sigma in _SELF_CHECK_PAIRS:
        ours, theirs = _replica(q, sigma, orders), _dp_accounting(q, sigma, orders)
        if not np.array_equal(ours, theirs):
            _log.warning("the replica of dp-accounting's sampled-Gaussian RDP differs from it at (q=%r, σ=%r); "
                         "using dp-accounting's own (slower) loops", q, sigma)
            return False
    return True


def _replica(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    alphas = [float(a) for a in orders]
    integer = [a for a in alphas if a.is_integer()]
    fractional = [a for a in alphas if not a.is_integer()]
    log_a = dict(zip(integer, _log_a_integer(q, sigma, integer), strict=True))
    log_a.update(zip(fractional, _log_a_fractional(q, sigma, fractional), strict=True))
    # compute_one_order: log A_α / (α − 1), then accumulated onto zeros (`0 + 1·x` is x).
    return np.array([log_a[a] / (a - 1) for a in alphas], dtype=float)


def _log_comb(n: np.ndarray | float, k: np.ndarray) -> np.ndarray:
    # dp-accounting's _log_comb, term for term.
    result: np.ndarray = special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)
    return result


def _log_a_integer(q: float, sigma: float, alphas: list[float]) -> list[float]:
    """_compute_log_a_int at each integer order: Σ_{i≤α} of one log term each, summed in order."""
    if not alphas:
        return []
    lengths = [int(a) + 1 for a in alphas]
    i = np.concatenate([np.arange(n, dtype=float) for n in lengths])
    alpha = np.repeat(np.array(alphas), lengths)
    log_q, log1mq = math.log(q), math.log1p(-q)
    s = _log_comb(alpha, i) + i * log_q + (alpha - i) * log1mq + (i * i - i) / (2 * (sigma**2))
    terms = s.tolist()
    exp, log1p, inf = math.exp, math.log1p, math.inf
    out, start = [], 0
    for n in lengths:
        log_a = -inf
        for term in terms[start : start + n]:
            # dp-accounting's _log_add(log_a, term), inlined (the loop's cost is its calls): (lo, hi)
            # is its (min, max), ties and NaN taken as min/max take them; lo = −∞ adds nothing.
            lo, hi = (term, log_a) if term < log_a else (log_a, term) if term > log_a else (log_a, log_a)
            log_a = hi if lo == -inf else log1p(exp(lo - hi)) + hi
        out.append(log_a)
        start += n
    return out


def _log_a_fractional(q: float, sigma: float, alphas: list[float]) -> list[float]:
    """_compute_log_a_frac at each fractional order: the two halves' series, stopped where it stops.

    Terms come in chunks (64, then doubling) for the orders still running, so an order that stops
    early costs few terms."""
    n = len(alphas)
    state = [[-math.inf, -math.inf, -math.inf, -math.inf] for _ in range(n)]  # a0, a1, last s0, last s1
    result = [math.inf] * n  # an order that never stops: dp-accounting's ∞ (it logs a warning)
    running = list(range(n))
    start, size = 0, _FIRST_CHUNK
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log1mq = math.log(q), math.log1p(-q)
    scale, two_sigma2 = math.sqrt(2) * sigma, 2 * (sigma**2)
    exp, log1p, inf = math.exp, math.log1p, math.inf
    while running and start < _MAX_FRACTIONAL_TERMS:
        stop = min(_MAX_FRACTIONAL_TERMS, start + size)
        i = np.arange(start, stop, dtype=float)[None, :]
        alpha = np.array([alphas[r] for r in running])[:, None]
        log_coef = _log_comb(alpha, i)
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log1mq
        log_t1 = log_coef + j * log_q + i * log1mq
        # math.log(0.5) + _log_erfc(x), where _log_erfc(x) = math.log(2) + log_ndtr(−x·2^0.5)
        log_e0 = math.log(0.5) + (math.log(2) + special.log_ndtr(-((i - z0) / scale) * 2**0.5))
        log_e1 = math.log(0.5) + (math.log(2) + special.log_ndtr(-((z0 - j) / scale) * 2**0.5))
        s0_rows = (log_t0 + (i * i - i) / two_sigma2 + log_e0).tolist()
        s1_rows = (log_t1 + (j * j - j) / two_sigma2 + log_e1).tolist()
        still = []
        for row, r in enumerate(running):
            a0, a1, last_s0, last_s1 = state[r]
            for s0, s1 in zip(s0_rows[row], s1_rows[row], strict=True):
                # _log_add(a0, s0) and _log_add(a1, s1), inlined as in _log_a_integer.
                lo, hi = (s0, a0) if s0 < a0 else (a0, s0) if s0 > a0 else (a0, a0)
                a0 = hi if lo == -inf else log1p(exp(lo - hi)) + hi
                lo, hi = (s1, a1) if s1 < a1 else (a1, s1) if s1 > a1 else (a1, a1)
                a1 = hi if lo == -inf else log1p(exp(lo - hi)) + hi
                # dp-accounting computes the total (_log_add(a0, a1)) every term but reads it only
                # here, after the two comparisons: computing it only when they hold changes nothing.
                if s0 < last_s0 and s1 < last_s1:
                    lo, hi = (a1, a0) if a1 < a0 else (a0, a1) if a1 > a0 else (a0, a0)
                    total = hi if lo == -inf else log1p(exp(lo - hi)) + hi
                    if (s1 if s1 > s0 else s0) < total - 30:  # max(s0, s1)
                        result[r] = total
                        break
                last_s0, last_s1 = s0, s1
            else:
                state[r] = [a0, a1, last_s0, last_s1]
                still.append(r)
        running = still
        start, size = stop, 2 * size
    return result
