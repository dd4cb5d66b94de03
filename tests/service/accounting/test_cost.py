"""The pricing of a request's accounting work (cost.py) against what dp-accounting actually builds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_mechanism

from dpledger.service.accounting import cost
from dpledger.service.accounting.events import MechanismError
from dpledger.wire.mechanisms import Composed, DpSgd, Gaussian, SelfComposed


@pytest.mark.parametrize(("sigma", "count"), [(2.0, 1), (2.0, 400), (0.7, 3)])
def test_the_gaussian_grid_estimate_is_the_accountants_grid(sigma: float, count: int) -> None:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(de.SelfComposedDpEvent(de.GaussianDpEvent(sigma), count))
    built = accountant._pld._pmf_remove.size  # the grid the accountant allocated
    estimate = cost.gaussian_loss_range(sigma / count**0.5) / 1e-3
    assert 0.5 * estimate <= built <= 1.01 * estimate + 2


def test_400_gaussians_are_priced_as_one_at_sigma_over_20() -> None:
    mechanism = SelfComposed(count=400, event=Gaussian(noise_multiplier=2.0))
    assert cost.check(mechanism) is None  # the report at 1e-3: ~295k points
    skip = cost.check(mechanism, pld_discretization=1e-4)
    assert skip is not None and "2.95e+06 points" in skip
    assert cost.check(Gaussian(noise_multiplier=0.1), pld_discretization=1e-4) == skip


def test_the_sampled_leaf_limit_is_15_as_stated() -> None:
    leaves = [DpSgd(sampling_rate=0.01 + i / 1000, noise_multiplier=1.0, steps=1) for i in range(16)]
    cost.check(Composed(events=leaves[: cost.MAX_SAMPLED_LEAVES]))
    with pytest.raises(MechanismError, match="16 distinct sampled leaves; one request may hold at most 15"):
        cost.check(Composed(events=leaves))


def test_a_gaussian_near_the_float_range_is_priced_not_a_crash() -> None:
    # dp-accounting squares σ in its privacy loss: at 1.5e307 that overflowed into a 500 (found by the fuzz test).
    assert cost.gaussian_loss_range(1.5e307) == pytest.approx(cost.gaussian_loss_range(1.0) / 1.5e307, rel=0.06)
    assert cost.check(Gaussian(noise_multiplier=1.5e307)) is None


def test_a_filter_allocation_widens_the_bound_of_the_request_it_runs_in_without_being_priced() -> None:
    """A first charge's, a refit's or a registration's allocation is work no mechanism's price counts
    (0.01–0.5 s): under the bare slack a busy CI machine stopped a search that fixed its silo's filter
    (a 422). It widens the request's CPU bound as it runs, and takes nothing from what the request
    may price or from its optional PLD reports."""
    from dpledger.service.accounting import filter as rdp_filter
    from dpledger.service.accounting import rdp

    step = rdp.certified_curve(DpSgd(noise_multiplier=1.0, steps=1, sampling_rate=0.01))
    with cost.guard("mechanism") as guard:
        bare = guard.allowance()
        rdp_filter.allocate(step, epsilon=3.0, delta=1e-5)
        assert guard.allowance() == pytest.approx(bare + cost.OVERRUN * cost.FIRST_FILTER_SECONDS)
        assert guard.admitted == 0.0 and cost._admitted_seconds() == 0.0
        rdp_filter.allocate(step, epsilon=3.0, delta=1e-5)  # a refit's second allocation: never past the cap
        assert guard.allowance() == cost.GUARD_SECONDS


def test_a_garbage_collection_on_the_requests_thread_is_not_its_work() -> None:
    """A full collection runs on whichever thread allocates when it is due and lasts as long as the whole
    heap: on a large CI process one stopped a 0.1 s calibration as an overrun (a 422). A guard counts the
    thread's CPU less its collections; the request's own work still counts."""
    import gc
    import time

    heap = [[i] for i in range(2_000_000)]  # a large process's heap: a full collection walks all of it
    with cost.guard("mechanism", seconds=10.0) as guard:
        before = time.thread_time()
        gc.collect()
        collected = time.thread_time() - before
        assert collected > 0.05  # the collection took real CPU on this thread…
        assert cost._working() - guard.started < collected / 5  # …which the guard does not count
        busy = time.thread_time()
        while time.thread_time() - busy < 0.2:  # the request's own work
            pass
        assert cost._working() - guard.started >= 0.2
    del heap


def test_the_sampled_loss_range_is_dp_accountings_own_bit_for_bit() -> None:
    """Read from dp-accounting's GaussianPrivacyLoss itself (its truncation points, its privacy loss),
    on a seeded family: σ 0.3–1000 and q 1e-7–1, and the corners where its arithmetic overflows."""
    def accountants(sigma: float, q: float) -> float:
        try:
            loss = privacy_loss_mechanism.GaussianPrivacyLoss(sigma, sampling_prob=q, log_mass_truncation_bound=-50.0)
            tail = loss.privacy_loss_tail()
            return float(loss.privacy_loss(tail.lower_x_truncation) - loss.privacy_loss(tail.upper_x_truncation))
        except (ArithmeticError, ValueError):
            return cost.gaussian_loss_range(sigma)

    rng = np.random.default_rng(40)
    cases = [(float(10 ** rng.uniform(-0.5, 3)), float(10 ** rng.uniform(-7, 0))) for _ in range(300)]
    cases += [(sigma, q) for sigma in (0.3, 1.0, 1e150, 1.5e307) for q in (1e-9, 0.5, 0.999999, 1.0)]
    for sigma, q in cases:
        ours, theirs = cost.sampled_loss_range(sigma, q), accountants(sigma, q)
        assert ours == theirs or (math.isnan(ours) and math.isnan(theirs)), (sigma, q, ours, theirs)
