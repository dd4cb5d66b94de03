"""reference_curve gives dp-accounting's RDP of a Poisson-sampled Gaussian to the bit, and falls back
to dp-accounting itself when it would not."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from dp_accounting.dp_event import GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import rdp, reference_curve

ORDERS = list(rdp.ORDERS)
# Rates from 1e-6 to 0.9 and noise from 0.3 to 3000 (tiny-q rounding, σ < 1 series that run long,
# q ~ 1/2 at large σ where a fractional order never stops), plus σ outside the replica's range.
PAIRS = [*itertools.product((1e-6, 3e-4, 0.01, 0.07, 0.5, 0.9), (0.3, 0.61, 1.0, 2.3, 17.0, 3000.0)), (0.01, 1e-7), (0.2, 1e9)]


def dp_accounting(q: float, sigma: float) -> np.ndarray:
    accountant = rdp_lib.RdpAccountant(ORDERS)
    accountant.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)))
    return np.asarray(accountant.rdp)


@pytest.mark.parametrize(("q", "sigma"), PAIRS)
def test_equals_dp_accountings_curve_to_the_bit(q: float, sigma: float) -> None:
    ours = reference_curve.curve(q, sigma, ORDERS)
    theirs = dp_accounting(q, sigma)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    # array_equal: every order the same float, ∞ where dp-accounting gives ∞ (its unconverged orders).
    assert np.array_equal(ours, theirs), np.flatnonzero(ours != theirs)


def test_the_grid_reaches_orders_that_never_converge_and_orders_below_zero() -> None:
    # The bit-for-bit test above is only as good as its pairs: they reach dp-accounting's ∞ (a fractional
    # series cut at 1000 terms) and its negative reading from rounding at σ = 3000.
    curves = [dp_accounting(q, sigma) for q, sigma in PAIRS]
    assert any(np.isinf(c).any() for c in curves)
    assert any((c < 0).any() for c in curves)


def test_a_replica_that_differs_is_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    honest = reference_curve._replica
    monkeypatch.setattr(reference_curve, "_replica", lambda q, sigma, orders: np.nextafter(honest(q, sigma, orders), np.inf))
    reference_curve._agrees.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=reference_curve.__name__):
            ours = reference_curve.curve(0.05, 1.3, ORDERS)
        assert np.array_equal(ours, dp_accounting(0.05, 1.3))
        assert "differs from it" in caplog.text
    finally:
        reference_curve._agrees.cache_clear()


def test_refuses_what_it_does_not_compute() -> None:
    for q, sigma in ((0.0, 1.0), (1.0, 1.0), (0.1, 0.0), (0.1, float("nan"))):
        with pytest.raises(ValueError, match="needs 0 < q < 1 and sigma > 0"):
            reference_curve.curve(q, sigma, ORDERS)
