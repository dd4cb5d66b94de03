"""A search's curve (repeat_and_select) on the ledger's certified curves: dp-accounting's formula over
the certified curve of one run (rdp.repeat_and_select), which is sound because the formula is
increasing in the run's curve and the run's certified curve is an upper bound on its exact one.

The run's certified curve is checked against a 50-digit reference in test_soundness.py; here, over
a seeded family of searches of DP-SGD runs and of Gaussians and every law (Poisson, logarithmic,
geometric, truncated negative binomial): the formula increasing in the run's curve (the premise),
the pad past its rounding, a reading never above dp-accounting's beyond float noise, equal to it on
an exact run (a Gaussian's), and the search quote's ε equal to what the gate then charges."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import rdp
from dpledger.service.ledger import searches
from dpledger.wire.mechanisms import AnyMechanism, DpSgd, Gaussian, RepeatAndSelect

SHAPES: list[float | str] = [0.0, 1.0, 0.5, 3.0, "infinity"]


def family(count: int, seed: int) -> list[tuple[AnyMechanism, de.DpEvent, float, float | str]]:
    rng = np.random.default_rng(seed)
    cases: list[tuple[AnyMechanism, de.DpEvent, float, float | str]] = []
    for k in range(count):
        if k % 3 == 2:
            sigma = float(rng.uniform(0.8, 5.0))
            run: AnyMechanism = Gaussian(noise_multiplier=sigma)
            event: de.DpEvent = de.GaussianDpEvent(sigma)
        else:
            q, sigma = float(10 ** rng.uniform(-3.5, -0.5)), float(rng.uniform(0.6, 3.0))
            steps = int(rng.choice([1, 10, 300]))
            run = DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q)
            event = de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)
        cases.append((run, event, float(rng.choice([1.0, 2.5, 10.0, 200.0])), SHAPES[k % len(SHAPES)]))
    return cases


@pytest.mark.parametrize(("run", "event", "mean", "shape"), family(12, seed=46))
def test_a_search_reads_its_runs_certified_curve_never_above_dp_accounting_beyond_float_noise(
    run: AnyMechanism, event: de.DpEvent, mean: float, shape: float | str
) -> None:
    """A Gaussian run's curve is exact in closed form, so the search equals dp-accounting's reading
    but for the pad past rounding. A DP-SGD run's certified curve is within ~1e-9 of its exact
    divergence (test_soundness.py) where dp-accounting's is at or above it (up to 35% on (1, 2)),
    so the search reads at most float noise above dp-accounting's, and often well below it."""
    ours = rdp.certified_curve(RepeatAndSelect(event=run, mean=mean, shape=shape))
    value = math.inf if shape == "infinity" else float(shape)
    oracle = rdp_lib.RdpAccountant(orders=list(rdp.ORDERS))
    oracle.compose(de.RepeatAndSelectDpEvent(event, mean, value))
    theirs = np.asarray(oracle.rdp)
    finite = np.isfinite(theirs)
    assert np.all(np.isfinite(ours[finite]))
    assert np.all(ours[finite] <= theirs[finite] * (1 + 1e-6)), np.max(ours[finite] / theirs[finite])
    if isinstance(run, Gaussian):
        assert np.all(ours[finite] >= theirs[finite]), np.min(ours[finite] / theirs[finite])
    # By construction: the formula over the run's certified curve, padded up.
    raw = np.asarray(rdp_lib._compute_rdp_repeat_and_select(list(rdp.ORDERS), rdp.certified_curve(run), mean, value))
    assert np.all(ours >= raw)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_formula_is_increasing_in_the_runs_curve_and_padded_past_its_rounding(shape: float | str) -> None:
    """The soundness argument's one premise, checked: a larger run's curve never reads a smaller search."""
    value = math.inf if shape == "infinity" else float(shape)
    run = rdp.certified_curve(DpSgd(noise_multiplier=1.1, steps=20, sampling_rate=0.01))
    rng = np.random.default_rng(7)
    base = rdp.repeat_and_select(run, mean=12.0, shape=value)
    raw = np.asarray(rdp_lib._compute_rdp_repeat_and_select(list(rdp.ORDERS), run, 12.0, value))
    assert np.all(base >= raw) and np.all(base <= raw * (1 + 1e-11))
    for _ in range(5):
        larger = run * (1 + rng.uniform(0, 1e-3, size=run.shape))
        assert np.all(rdp.repeat_and_select(larger, mean=12.0, shape=value) >= base)


def test_a_search_quote_states_what_the_search_then_charges() -> None:
    trial = DpSgd(noise_multiplier=1.3, steps=50, sampling_rate=0.02)
    delta = 1e-5
    quoted = searches.quote(trial, delta=delta, mean_trials=8.0, grid_size=None, tnb_shapes=[2.0])
    for law, epsilon in quoted.searches:
        charged = rdp.certified_curve(searches.search_mechanism(trial, law))
        assert epsilon == rdp.epsilon(charged, delta=delta)[0]
