"""Certified fractional orders of the Poisson-sampled Gaussian against a 40-digit integration oracle.

The oracle integrates the density ratio of P = (1−q)N(0,σ²) + qN(1,σ²) over Q = N(0,σ²) with mpmath's
tanh-sinh quadrature at 40 digits, split where the integrand changes shape (0, the crossing point z0,
and α, where the tilted Gaussian peaks), and refuses to answer if mpmath's own error estimate is not
30 digits below the value.
"""

from __future__ import annotations

import itertools
import math

import mpmath as mp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import fractional, rdp
from dpledger.wire.mechanisms import DpSgd


def oracle_rdp(q: float, sigma: float, alpha: float) -> mp.mpf:
    with mp.workdps(40):
        q_, s, a = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        z0 = s * s * mp.log(1 / q_ - 1) + mp.mpf(1) / 2

        def integrand(z: mp.mpf) -> mp.mpf:
            return mp.npdf(z, 0, s) * (1 - q_ + q_ * mp.exp((2 * z - 1) / (2 * s * s))) ** a

        points = sorted({-mp.inf, mp.mpf(0), z0, a, mp.inf})
        value, error = mp.quad(integrand, points, error=True)
        assert error < value * mp.mpf(10) ** -30, (q, sigma, alpha, error)
        return mp.log(value) / (a - 1)


GRID = list(itertools.product((0.001, 0.01, 0.1, 0.5), (0.5, 1.0, 2.0), (1.1, 1.5, 1.9, 3.7, 8.3)))


@pytest.mark.parametrize("q,sigma,alpha", GRID)
def test_certified_value_is_above_the_oracle_and_within_1e_6(q: float, sigma: float, alpha: float) -> None:
    exact = oracle_rdp(q, sigma, alpha)
    certified = fractional.rdp_upper(q=q, sigma=sigma, alpha=alpha)
    assert mp.mpf(certified) >= exact, (certified, exact)
    assert (mp.mpf(certified) - exact) / exact <= 1e-6


def test_it_is_tighter_than_dp_accounting_on_1_2_and_finite_where_dp_accounting_gives_up() -> None:
    # dp-accounting sums |terms|: 2–35% high on (1, 2), and ∞ where its loop does not settle.
    dpa = rdp_lib._compute_rdp_poisson_subsampled_gaussian(0.1, 1.0, [1.5])[0]
    ours = fractional.rdp_upper(q=0.1, sigma=1.0, alpha=1.5)
    assert ours < dpa / 1.02
    assert math.isinf(rdp_lib._compute_rdp_poisson_subsampled_gaussian(0.5, 0.5, [1.5])[0])
    assert math.isfinite(fractional.rdp_upper(q=0.5, sigma=0.5, alpha=1.5))


def test_the_ledger_curve_keeps_dp_accounting_at_integer_orders_and_never_exceeds_it() -> None:
    mechanism = DpSgd(noise_multiplier=0.8, steps=30, sampling_rate=0.05)
    ours, theirs = rdp.certified_curve(mechanism), rdp.rdp_curve(mechanism)
    integer = np.array([float(a).is_integer() for a in rdp.ORDERS])
    assert np.array_equal(ours[integer], theirs[integer])
    assert np.all(ours <= theirs)
    assert np.any(ours[~integer] < theirs[~integer] * 0.99)


@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.5])
def test_integer_or_sub_one_orders_are_refused(alpha: float) -> None:
    with pytest.raises(ValueError, match="fractional alpha"):
        fractional.rdp_upper(q=0.1, sigma=1.0, alpha=alpha)
