"""The exact RDP of one Poisson-sampled Gaussian step at 50 digits (mpmath): the reference that the
ledger's certified curves must never fall below (tests/service/accounting/test_soundness.py).

Integer orders: the finite sum of Mironov, Talwar & Zhang (2019, §3.3), A_α − 1 = Σ_{k≥2} C(α, k)
(1 − q)^{α−k} q^k (e^{(k²−k)/2σ²} − 1), which has no cancellation. Fractional orders: A_α − 1 =
E_z[(1 + x)^α − 1 − αx] with x = q(e^{(2z−1)/2σ²} − 1), z ~ N(0, σ²) (E[x] = 0), a non-negative
integrand, by tanh-sinh quadrature split where it changes shape; mpmath's own error estimate must be
20 digits below the value or the reference refuses to answer. D_α = log(A_α)/(α − 1)."""

from __future__ import annotations

import mpmath as mp

DIGITS = 50


def exact_rdp(q: float, sigma: float, alpha: float) -> mp.mpf:
    with mp.workdps(DIGITS):
        q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        if float(alpha).is_integer():
            n = int(alpha)
            minus_one = mp.fsum(mp.binomial(n, k) * (1 - q_) ** (n - k) * q_**k * mp.expm1((k * k - k) / (2 * s * s))
                                for k in range(2, n + 1))
        else:
            z0 = s * s * mp.log(1 / q_ - 1) + mp.mpf(1) / 2

            def integrand(z: mp.mpf) -> mp.mpf:
                x = q_ * mp.expm1((2 * z - 1) / (2 * s * s))
                return mp.npdf(z, 0, s) * ((1 + x) ** a - 1 - a * x)

            points = sorted({-mp.inf, -8 * s, mp.mpf(0), mp.mpf(1) / 2, z0, a, 8 * s + a, mp.inf})
            minus_one, error = mp.quad(integrand, points, error=True, maxdegree=10)
            assert error < abs(minus_one) * mp.mpf(10) ** -20, (q, sigma, alpha, error, minus_one)
        return mp.log1p(minus_one) / (a - 1)


def exact_epsilon(order: float, rdp_value: mp.mpf, delta: float) -> mp.mpf:
    """dp-accounting's conversion (Canonne, Kamath & Steinke 2020, Prop. 12, with its KL branch) at 50 digits."""
    with mp.workdps(DIGITS):
        r, a, d = mp.mpf(rdp_value), mp.mpf(order), mp.mpf(delta)
        if d**2 + mp.expm1(-r) > 0:
            return mp.mpf(0)
        return max(mp.mpf(0), r + mp.log1p(-1 / a) - mp.log(d * a) / (a - 1))
