"""RDP curves, the test pyramid of dp-accounting: an independent oracle, algebraic identities,
and published numbers; then the running sum a ledger keeps, and the per-leaf cache.

The oracle is ONE `dp_accounting.rdp.RdpAccountant` per history, composing dp_accounting events that
this file builds itself (and checks equal to `to_dp_event`); the service instead sums one cached
curve per mechanism. New Poisson-sampled (q, σ) curves cost ~50 ms, so histories draw from a small
pool of them.
"""

from __future__ import annotations

import base64
import json
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting import privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from pydantic import TypeAdapter, ValidationError

from dpledger.service.accounting import rdp, running_sum
from dpledger.service.accounting.events import MechanismError, resolve, to_dp_event
from dpledger.service.accounting.running_sum import (
    RunningSum,
    curve_from_json,
    curve_to_json,
)
from dpledger.wire.mechanisms import (
    AnyMechanism,
    Composed,
    DpSgd,
    Gaussian,
    Laplace,
    Mechanism,
    PoissonSampled,
    RepeatAndSelect,
    SampledWithoutReplacement,
    SelfComposed,
    ZCdp,
)

ORDERS = np.array(rdp_lib.DEFAULT_RDP_ORDERS, dtype=float)
DELTAS = (1e-3, 1e-5, 1e-9, 1e-14)
REL = 1e-9
DATASET_SIZE = 1000  # the silo size dpsgd batch sizes resolve against


def assert_curves_agree(ours: np.ndarray, oracle: np.ndarray, rel: float = REL) -> None:
    assert ours.shape == oracle.shape == ORDERS.shape
    assert not np.any(np.isnan(ours)) and not np.any(np.isnan(oracle))
    inf_ours, inf_oracle = np.isinf(ours), np.isinf(oracle)
    assert np.array_equal(inf_ours, inf_oracle), (ORDERS[inf_ours], ORDERS[inf_oracle])
    assert np.all(ours[inf_ours] > 0)
    a, b = ours[~inf_ours], oracle[~inf_oracle]
    assert np.all(np.abs(a - b) <= rel * np.maximum(np.abs(a), np.abs(b))), np.max(np.abs(a - b) / np.abs(b))


def assert_close(ours: float, oracle: float, rel: float = REL) -> None:
    if math.isinf(oracle) or math.isinf(ours):
        assert ours == oracle
    else:
        assert abs(ours - oracle) <= rel * max(abs(ours), abs(oracle)), (ours, oracle)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


# --- random histories: (mechanism, the dp_accounting event it must mean) ---------------------------

Pair = tuple[AnyMechanism, de.DpEvent]


def gauss(sigma: float) -> Pair:
    return Gaussian(noise_multiplier=sigma), de.GaussianDpEvent(sigma)


def self_composed(count: int, inner: Pair) -> Pair:
    return SelfComposed(count=count, event=inner[0]), de.SelfComposedDpEvent(inner[1], count)


def composed(*inner: Pair) -> Pair:
    return Composed(events=[m for m, _ in inner]), de.ComposedDpEvent([e for _, e in inner])


def poisson(q: float, inner: Pair) -> Pair:
    return PoissonSampled(sampling_rate=q, event=inner[0]), de.PoissonSampledDpEvent(q, inner[1])


def repeat_and_select(inner: Pair, mean: float, shape: float | str) -> Pair:
    value = math.inf if shape == "infinity" else float(shape)
    return RepeatAndSelect(event=inner[0], mean=mean, shape=shape), de.RepeatAndSelectDpEvent(inner[1], float(mean), value)


# Every Poisson-sampled Gaussian below reduces to one of few (q, σ_eff) pairs, so its curve is cheap
# after the first time; dpsgd steps reuse the first two exactly (10/1000 == 0.01, 1/1000 == 0.001).
POISSON_POOL: list[Callable[[], Pair]] = [
    lambda: poisson(0.01, gauss(1.5)),
    lambda: poisson(0.001, gauss(3.0)),
    lambda: poisson(0.01, composed(gauss(2.0), gauss(2.0))),
    lambda: poisson(0.001, self_composed(4, gauss(3.0))),
    lambda: poisson(0.01, composed(self_composed(2, gauss(3.0)), gauss(4.0))),
]
# dp-accounting's series for fractional orders does not converge at q = 0.05, σ = 0.7 and returns +inf
# at orders 1.1–1.4: the curve is infinite at a few orders, which both sides must agree on.
INFINITE_LOW_ORDERS: Callable[[], Pair] = lambda: poisson(0.05, gauss(0.7))  # noqa: E731
DPSGD_POOL = [(10, 1.5), (1, 3.0)]  # (batch_size, σ) → q = batch_size / DATASET_SIZE
SHAPES: list[float | str] = [0, 1, 0.5, 2, "infinity"]


def dpsgd(rng: random.Random) -> Pair:
    batch, sigma = rng.choice(DPSGD_POOL)
    steps = rng.choice([1, 30, 1000])
    q = batch / DATASET_SIZE
    event = de.SelfComposedDpEvent(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)
    if rng.random() < 0.7:
        return DpSgd(noise_multiplier=sigma, steps=steps, batch_size=batch), event  # resolved by the service
    return DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q), event


def leaf(rng: random.Random) -> Pair:
    r = rng.random()
    if r < 0.20:
        return gauss(rng.choice([0.8, 1.5, 4.0]))
    if r < 0.35:
        b = rng.choice([0.5, 2.0, 10.0])
        return Laplace(noise_multiplier=b), de.LaplaceDpEvent(b)
    if r < 0.50:
        rho, xi = rng.choice([0.01, 0.3]), rng.choice([0.0, 0.0, 0.05])
        m = ZCdp(rho=rho) if xi == 0.0 and rng.random() < 0.5 else ZCdp(rho=rho, xi=xi)
        return m, de.ZCDpEvent(rho, xi)
    if r < 0.62:
        return rng.choice(POISSON_POOL)()
    if r < 0.65:
        return INFINITE_LOW_ORDERS()
    if r < 0.77:
        return dpsgd(rng)
    # repeat-and-select over a cheap base (and, rarely, over a Poisson-sampled Gaussian)
    base_r = rng.random()
    if base_r < 0.3:
        base = gauss(rng.choice([1.5, 4.0]))
    elif base_r < 0.55:
        b = rng.choice([0.5, 2.0])
        base = (Laplace(noise_multiplier=b), de.LaplaceDpEvent(b))
    elif base_r < 0.75:
        base = (ZCdp(rho=0.05, xi=0.01), de.ZCDpEvent(0.05, 0.01))
    elif base_r < 0.9:
        base = self_composed(3, gauss(4.0))
    else:
        base = POISSON_POOL[0]()
    return repeat_and_select(base, rng.choice([1, 3.5, 20]), rng.choice(SHAPES))


def mechanism(rng: random.Random, depth: int) -> Pair:
    r = rng.random()
    if depth <= 1 or r < 0.55:
        return leaf(rng)
    if r < 0.78:
        return self_composed(rng.choice([1, 2, 7, 250]), mechanism(rng, depth - 1))
    return composed(*[mechanism(rng, depth - 1) for _ in range(rng.randint(1, 3))])


def kinds(m: AnyMechanism) -> list[str]:
    """Every kind in the tree, with repeat_and_select's shape and zcdp's xi spelled out."""
    label: str = m.type
    if isinstance(m, RepeatAndSelect):
        label = f"repeat_and_select:{m.shape}"
    elif isinstance(m, ZCdp):
        label = "zcdp:xi" if m.xi else "zcdp"
    elif isinstance(m, PoissonSampled):
        label = f"poisson_sampled:{m.event.type}"
    elif isinstance(m, DpSgd):
        label = "dpsgd:batch" if m.batch_size else "dpsgd:rate"
    children = list(m.events) if isinstance(m, Composed) else ([m.event] if hasattr(m, "event") else [])
    return [label, *[k for c in children for k in kinds(c)]]


def histories(seed: int, n: int) -> list[list[Pair]]:
    rng = random.Random(seed)
    return [[mechanism(rng, depth=3) for _ in range(rng.randint(1, 4))] for _ in range(n)]


HISTORIES = histories(seed=1729, n=100)


def test_the_random_histories_cover_every_kind() -> None:
    seen = Counter(k for history in HISTORIES for m, _ in history for k in kinds(m))
    wanted = {
        "gaussian", "laplace", "zcdp", "zcdp:xi", "self_composed", "composed", "dpsgd:batch", "dpsgd:rate",
        "poisson_sampled:gaussian", "poisson_sampled:composed", "poisson_sampled:self_composed",
        *[f"repeat_and_select:{s}" for s in ("0.0", "1.0", "0.5", "2.0", "infinity")],
    }
    assert wanted <= set(seen), wanted - set(seen)
    assert len(HISTORIES) >= 100


def test_summed_curves_match_one_rdp_accountant_on_random_histories() -> None:
    """The ledger's way (a sum of one curve per mechanism) against dp-accounting's (one accountant
    composing every event): curves and ε at several δ agree to 1e-9 relative, infinities included."""
    with_infinity = 0
    for history in HISTORIES:
        oracle = rdp_lib.RdpAccountant(orders=rdp_lib.DEFAULT_RDP_ORDERS)
        running = RunningSum.empty(len(rdp.ORDERS))
        curves = []
        for m, event in history:
            resolved = resolve(m, dataset_size=DATASET_SIZE)
            assert to_dp_event(resolved) == event, resolved
            oracle.compose(event)
            curve = rdp.rdp_curve(resolved)
            curves.append(curve)
            running = running.add(curve)
        summed = np.sum(curves, axis=0)
        assert_curves_agree(summed, oracle.rdp)
        assert_curves_agree(running.curve(), oracle.rdp)
        with_infinity += bool(np.any(np.isinf(oracle.rdp)))
        for delta in DELTAS:
            eps, _ = rdp.epsilon(summed, delta=delta)
            assert_close(eps, float(oracle.get_epsilon(delta)))
            assert_close(rdp.epsilon(running.curve(), delta=delta)[0], float(oracle.get_epsilon(delta)))
    assert with_infinity >= 3  # the infinite-order case was exercised, not just allowed for


def wor(n: int, m: int, inner: Pair) -> Pair:
    return (SampledWithoutReplacement(source_size=n, sample_size=m, event=inner[0]),
            de.SampledWithoutReplacementDpEvent(n, m, inner[1]))


WOR_POOL: list[Callable[[], Pair]] = [
    lambda: wor(1000, 10, gauss(1.5)),
    lambda: wor(60000, 150, composed(gauss(2.0), gauss(2.0))),
    lambda: wor(100, 100, self_composed(2, gauss(3.0))),  # q = 1
]


def test_sampling_without_replacement_matches_a_replace_one_accountant() -> None:
    rng = random.Random(31337)
    for _ in range(5):
        oracle = rdp_lib.RdpAccountant(
            orders=rdp_lib.DEFAULT_RDP_ORDERS, neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE
        )
        total = rdp.zero_curve()
        for _ in range(rng.randint(1, 2)):
            pair = rng.choice(WOR_POOL)()
            r = rng.random()
            if r < 0.3:
                pair = self_composed(rng.choice([2, 40]), pair)
            elif r < 0.5:
                pair = composed(pair, rng.choice(WOR_POOL)())
            m, event = pair
            assert to_dp_event(m) == event
            oracle.compose(event)
            total = total + rdp.rdp_curve(m)
        assert_curves_agree(total, oracle.rdp)
        for delta in DELTAS:
            assert_close(rdp.epsilon(total, delta=delta)[0], float(oracle.get_epsilon(delta)))


@pytest.mark.parametrize("shape", [1, "infinity"])
def test_repeat_and_select_over_sampling_without_replacement_is_accounted_or_refused(shape: Any) -> None:
    """dp-accounting accounts repeat-and-select of a without-replacement sample under REPLACE_ONE; the
    service must give that curve, or refuse the mechanism as invalid. It must not crash."""
    raw = {"type": "repeat_and_select", "mean": 3, "shape": shape,
           "event": {"type": "sampled_without_replacement", "source_size": 1000, "sample_size": 10,
                     "event": {"type": "gaussian", "noise_multiplier": 1.5}}}
    oracle = rdp_lib.RdpAccountant(
        orders=rdp_lib.DEFAULT_RDP_ORDERS, neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE
    )
    oracle.compose(de.RepeatAndSelectDpEvent(de.SampledWithoutReplacementDpEvent(1000, 10, de.GaussianDpEvent(1.5)), 3.0,
                                             math.inf if shape == "infinity" else 1.0))
    try:
        m = TypeAdapter(Mechanism).validate_python(raw)
        curve = rdp.rdp_curve(m)
    except (ValidationError, MechanismError):
        return  # refused as invalid: acceptable
    assert_curves_agree(curve, oracle.rdp)


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "poisson_sampled", "sampling_rate": 0.5, "event": {"type": "laplace", "noise_multiplier": 1.0}},
        {"type": "poisson_sampled", "sampling_rate": 0.5, "event": {"type": "zcdp", "rho": 0.1}},
        {"type": "poisson_sampled", "sampling_rate": 0.5,
         "event": {"type": "dpsgd", "noise_multiplier": 1.0, "steps": 3, "sampling_rate": 0.1}},
        {"type": "sampled_without_replacement", "source_size": 100, "sample_size": 10,
         "event": {"type": "laplace", "noise_multiplier": 1.0}},
        {"type": "laplace", "noise_multiplier": 5e-324},  # 1 / b overflows to +inf inside dp-accounting
    ],
)
def test_a_mechanism_that_validates_has_a_curve_or_a_named_refusal(raw: dict[str, Any]) -> None:
    """Whatever passes validation either gets a curve (+inf is a fine answer: it is never approved) or
    is refused with a MechanismError naming the field; an exception from inside dp-accounting would be
    an unhandled 500 at the API."""
    try:
        m = TypeAdapter(Mechanism).validate_python(raw)
    except ValidationError:
        return
    try:
        curve = rdp.rdp_curve(m)
    except MechanismError as error:
        assert error.field.startswith("mechanism")
        return
    assert curve.shape == ORDERS.shape and not np.any(np.isnan(curve))


def test_an_unresolved_dpsgd_has_no_curve() -> None:
    with pytest.raises(MechanismError) as caught:
        rdp.rdp_curve(DpSgd(noise_multiplier=1.0, steps=10, batch_size=5))
    assert caught.value.field == "mechanism.batch_size"


# --- algebraic identities -----------------------------------------------------------------------------

IDENTITY_CASES: list[AnyMechanism] = [
    Gaussian(noise_multiplier=1.5),
    Laplace(noise_multiplier=2.0),
    ZCdp(rho=0.3, xi=0.05),
    PoissonSampled(sampling_rate=0.01, event=Gaussian(noise_multiplier=1.5)),
    PoissonSampled(sampling_rate=0.05, event=Gaussian(noise_multiplier=0.7)),  # infinite at low orders
    RepeatAndSelect(event=Laplace(noise_multiplier=2.0), mean=10, shape=0.5),
    RepeatAndSelect(event=Gaussian(noise_multiplier=4.0), mean=3.5, shape="infinity"),
    DpSgd(noise_multiplier=3.0, steps=30, sampling_rate=0.001),
    Composed(events=[Gaussian(noise_multiplier=4.0), ZCdp(rho=0.01)]),
]


@pytest.mark.parametrize("m", IDENTITY_CASES, ids=lambda m: m.type)
@pytest.mark.parametrize("k", [1, 2, 6, 11])
def test_k_compositions_equal_self_composed_k(m: AnyMechanism, k: int) -> None:
    one = rdp.rdp_curve(m)
    k_times = rdp.zero_curve()
    for _ in range(k):
        k_times = k_times + rdp.rdp_curve(m)
    self_k = rdp.rdp_curve(SelfComposed(count=k, event=m))
    assert_curves_agree(k_times, self_k, rel=1e-13)
    assert np.array_equal(self_k, k * one)
    for delta in DELTAS:
        assert_close(rdp.epsilon(k_times, delta=delta)[0], rdp.epsilon(self_k, delta=delta)[0], rel=1e-13)
    if k > 6:
        return  # the accountant recomputes each (q, σ) curve on every compose: keep it short
    # and through the composition of one accountant, the way dp-accounting counts it
    accountant = rdp_lib.RdpAccountant(orders=rdp_lib.DEFAULT_RDP_ORDERS)
    for _ in range(k):
        accountant.compose(to_dp_event(m))
    assert_curves_agree(self_k, accountant.rdp)


@pytest.mark.parametrize("a", IDENTITY_CASES[:5], ids=lambda m: m.type)
@pytest.mark.parametrize("b", IDENTITY_CASES[5:], ids=lambda m: m.type)
def test_composed_a_b_equals_a_plus_b(a: AnyMechanism, b: AnyMechanism) -> None:
    both = rdp.rdp_curve(Composed(events=[a, b]))
    assert np.array_equal(both, rdp.rdp_curve(a) + rdp.rdp_curve(b))
    assert np.array_equal(rdp.rdp_curve(Composed(events=[b, a])), both)
    for delta in DELTAS:
        eps_both, _ = rdp.epsilon(both, delta=delta)
        # composition never costs less than either part
        assert eps_both >= max(rdp.epsilon(rdp.rdp_curve(a), delta=delta)[0], rdp.epsilon(rdp.rdp_curve(b), delta=delta)[0])


@pytest.mark.parametrize(("q", "sigma"), [(0.01, 1.5), (0.001, 3.0), (0.05, 0.7)])
@pytest.mark.parametrize("steps", [1, 7, 6000])
def test_dpsgd_equals_steps_of_a_poisson_sampled_gaussian(q: float, sigma: float, steps: int) -> None:
    step = PoissonSampled(sampling_rate=q, event=Gaussian(noise_multiplier=sigma))
    sgd = DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q)
    spelled_out = SelfComposed(count=steps, event=step)
    assert to_dp_event(sgd) == to_dp_event(spelled_out)
    curve = rdp.rdp_curve(sgd)
    assert np.array_equal(curve, rdp.rdp_curve(spelled_out))
    assert np.array_equal(curve, steps * rdp.rdp_curve(step))
    for delta in DELTAS:
        assert rdp.epsilon(curve, delta=delta) == rdp.epsilon(rdp.rdp_curve(spelled_out), delta=delta)


# --- published values ---------------------------------------------------------------------------------

# TensorFlow Privacy's compute_dp_sgd_privacy_lib orders, and its test cases
# (compute_dp_sgd_privacy_test.py: n, batch_size, noise_multiplier, epochs, delta, ε, order).
TF_PRIVACY_ORDERS = [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, *range(5, 64), 128, 256, 512]
TF_PRIVACY_CASES = [
    (60000, 150, 1.3, 15, 1e-5, 0.7242234026109595, 19.0),
    (100000, 100, 1.0, 30, 1e-7, 1.4154988495444845, 13.0),
    (100000000, 1024, 0.1, 10, 1e-7, 5907982.31138195, 1.25),
]


@pytest.mark.parametrize(("n", "batch", "sigma", "epochs", "delta", "eps", "order"), TF_PRIVACY_CASES)
def test_tensorflow_privacy_dpsgd_epsilons(
    n: int, batch: int, sigma: float, epochs: int, delta: float, eps: float, order: float
) -> None:
    steps = math.ceil(epochs * n / batch)
    m = resolve(DpSgd(noise_multiplier=sigma, steps=steps, batch_size=batch), dataset_size=n)
    assert m.sampling_rate == batch / n  # type: ignore[union-attr]

    # On TF Privacy's own order list, the same event gives their ε at their order.
    theirs = rdp_lib.RdpAccountant(orders=TF_PRIVACY_ORDERS)
    theirs.compose(to_dp_event(m))
    eps_tf, order_tf = theirs.get_epsilon_and_optimal_order(delta)
    assert rel_diff(eps_tf, eps) <= 1e-9 and order_tf == order

    ours, our_order = rdp.epsilon(rdp.rdp_curve(m), delta=delta)
    if order in rdp.ORDERS:
        # Where our grid holds TF Privacy's optimal order it is also ours, and the ε is the same number.
        assert our_order == order
        assert rel_diff(ours, eps) <= 1e-9
    else:
        # 1.25 is not on our grid; our finer low orders find 1.1 and a (much) smaller valid ε.
        assert our_order == 1.1
        assert ours < eps
        assert rel_diff(ours, 7801.056742860663) <= 1e-9  # pinned: dp-accounting 0.6.0 on DEFAULT_RDP_ORDERS


def test_tensorflow_privacy_mnist_case_steps() -> None:
    # The 15-epoch MNIST case is 6000 steps at q = 0.0025, at order 19 on both grids.
    assert 15 * 60000 // 150 == 6000 and 150 / 60000 == 0.0025
    curve = rdp.rdp_curve(DpSgd(noise_multiplier=1.3, steps=6000, sampling_rate=0.0025))
    eps, order = rdp.epsilon(curve, delta=1e-5)
    assert order == 19.0
    assert rel_diff(eps, 0.7242234026) <= 1e-9


def _tnb_gamma_bound(mean: float, shape: float) -> float:
    """log(1/γ) ≤ log(1 + mean/η) for the truncated negative binomial with η > 0, because its mean
    η(1−γ)/(γ(1−γ^η)) ≥ η(1/γ − 1)."""
    return math.log(1 + mean / shape)


@pytest.mark.parametrize("b", [0.5, 1.0, 2.0, 10.0])
@pytest.mark.parametrize("shape", [0.5, 1, 2])
@pytest.mark.parametrize("mean", [2, 10, 100])
def test_papernot_steinke_pure_dp_repeated_costs_at_most_2_plus_eta_eps0(b: float, shape: float, mean: float) -> None:
    """Papernot & Steinke 2022, Thm 2 / Cor. 3. Laplace with noise multiplier b is ε₀ = 1/b pure DP
    (so (λ, ε₀)-RDP at every λ); run K ~ TNB(η, γ) times with E[K] = mean, the best one released, it is
    ((2+η)ε₀)-DP. Theorem 2 at λ̂ = 1024 (our largest order) with ε̂ ≤ ε₀ bounds the RDP that
    dp-accounting computes at every order λ of our grid by

        (2+η)ε₀ + (1+η)·log(1/γ)/1024 + log(mean)/(λ−1),

    the pure-DP limit plus terms that vanish as the orders grow. dp-accounting never returns exactly
    (2+η)ε₀ on a finite grid; the assertions below are that bound, and its tightness at the top order."""
    eps0 = 1 / b
    limit = (2 + shape) * eps0
    curve = rdp.rdp_curve(RepeatAndSelect(event=Laplace(noise_multiplier=b), mean=mean, shape=shape))
    bound = limit + (1 + shape) * _tnb_gamma_bound(mean, shape) / 1024 + math.log(mean) / (ORDERS - 1)
    assert np.all(np.isfinite(curve))
    assert np.all(curve <= bound * (1 + 1e-12)), ORDERS[curve > bound]
    # At our largest order, less the log(mean)/(λ−1) term, the curve sits within the vanishing term
    # above the limit; for mean ≥ 10 and ε₀ ≤ 1 it is also within 1% below it (the pure-DP regime).
    top = curve[-1] - math.log(mean) / (ORDERS[-1] - 1)
    assert top <= limit + (1 + shape) * _tnb_gamma_bound(mean, shape) / 1024
    if mean >= 10 and eps0 <= 1:
        assert top >= limit * (1 - 0.01)


# --- the running sum a ledger keeps ---------------------------------------------------------------------


def random_curve(rng: np.random.Generator, *, infinite: bool) -> np.ndarray:
    curve = rng.choice([1e-9, 1e-3, 0.3, 7.0, 1e4]) * rng.random(len(ORDERS))
    if infinite:
        curve[rng.choice(len(ORDERS), size=rng.integers(1, 6), replace=False)] = np.inf
    return curve


def test_release_restores_the_infinite_counts_exactly() -> None:
    rng = np.random.default_rng(5)
    base = RunningSum.empty(len(ORDERS))
    for _ in range(5):
        base = base.add(random_curve(rng, infinite=True))
    for _ in range(100):
        curve = random_curve(rng, infinite=bool(rng.random() < 0.5))
        after = base.add(curve)
        assert np.array_equal(after.infinite, base.infinite + np.isinf(curve))
        assert np.all(np.isinf(after.curve()[np.isinf(curve)]))
        back = after.subtract(curve)
        assert np.array_equal(back.infinite, base.infinite)
        assert back.infinite.dtype == np.int64
        assert np.array_equal(np.isinf(back.curve()), np.isinf(base.curve()))


def test_an_infinite_order_stays_infinite_until_every_infinite_charge_is_released() -> None:
    inf_at_0 = np.zeros(len(ORDERS))
    inf_at_0[0] = np.inf
    s = RunningSum.empty(len(ORDERS)).add(inf_at_0).add(inf_at_0)
    assert s.infinite[0] == 2 and np.isinf(s.curve()[0])
    s = s.subtract(inf_at_0)
    assert s.infinite[0] == 1 and np.isinf(s.curve()[0])
    s = s.subtract(inf_at_0)
    assert s.infinite[0] == 0 and s.curve()[0] == 0.0
    assert not np.any(np.isnan(s.finite))


def test_release_never_leaves_the_sum_below_what_it_was() -> None:
    """add(c) then subtract(c) must give back the sum exactly, or more (the privacy-safe side): a sum
    rounded below the charges it holds would approve a little more than the budget allows."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        base = RunningSum.empty(len(ORDERS))
        for _ in range(int(rng.integers(0, 4))):
            base = base.add(random_curve(rng, infinite=bool(rng.random() < 0.3)))
        curve = random_curve(rng, infinite=bool(rng.random() < 0.3))
        back = base.add(curve).subtract(curve)
        assert np.array_equal(back.infinite, base.infinite)
        below = back.finite < base.finite
        assert not np.any(below), (base.finite[below][:3], back.finite[below][:3])


def test_release_after_another_charge_never_undercounts_it() -> None:
    # Minimal case of the above: reserve a, reserve b, release a must leave at least b.
    a, b = np.full(len(ORDERS), 0.6), np.full(len(ORDERS), 0.3)
    s = RunningSum.empty(len(ORDERS)).add(a).add(b).subtract(a)
    assert np.all(s.finite >= b), s.finite[0]


def test_release_clamps_at_zero() -> None:
    c = np.full(len(ORDERS), 0.1)
    s = RunningSum.empty(len(ORDERS)).add(c).subtract(c).subtract(c)
    assert np.all(s.finite == 0.0)


def test_running_sum_round_trips_through_json_with_infinities() -> None:
    rng = np.random.default_rng(3)
    s = RunningSum.empty(len(ORDERS))
    for _ in range(4):
        s = s.add(random_curve(rng, infinite=True))
    s = s.add(np.array([5e-324, 1e-300, 1.7976931348623157e308 / 4, *([1 / 3] * (len(ORDERS) - 3))]))
    back = RunningSum.from_json(s.to_json())
    assert np.array_equal(back.finite, s.finite)
    assert np.array_equal(back.infinite, s.infinite)
    assert back.infinite.dtype == np.int64 and back.finite.dtype == np.float64
    assert np.array_equal(back.curve(), s.curve())
    assert back.to_json() == s.to_json()
    assert np.any(np.isinf(back.curve()))
    empty = RunningSum.empty(len(ORDERS))
    assert np.array_equal(RunningSum.from_json(empty.to_json()).curve(), np.zeros(len(ORDERS)))


def _stored(text: str) -> tuple[np.ndarray, np.ndarray]:
    """The stored form, decoded independently: "b64:", the float64 bytes in base64, then ":" and the
    int64 infinite counts where any is nonzero (revision 0015)."""
    assert text.startswith("b64:")
    finite, _, infinite = text[4:].partition(":")
    values = np.frombuffer(base64.b64decode(finite), dtype="<f8")
    counts = np.frombuffer(base64.b64decode(infinite), dtype="<i8") if infinite else np.zeros(len(values), dtype=np.int64)
    return values, counts


def test_a_sum_is_written_as_text_that_holds_the_very_floats_and_an_overflow_stays_infinite() -> None:
    # The text must decode (independently of RunningSum) to the very floats, and an overflowed order
    # must read ∞, never NaN; 156 orders take 1,668 characters (JSON took ~3,400).
    rng = np.random.default_rng(5)
    for _ in range(200):
        finite = rng.random(len(ORDERS)) * 10.0 ** rng.integers(-320, 308, len(ORDERS))
        finite[:6] = [5e-324, 1e-5, 0.1 + 0.2, 1e16, 1.7976931348623157e308, 0.0]
        text = RunningSum(finite, np.zeros(len(ORDERS), dtype=np.int64)).to_json()
        assert _stored(text)[0].tobytes() == finite.tobytes() and len(text) == 4 + 4 * math.ceil(8 * len(ORDERS) / 3)
    big = RunningSum.empty(len(ORDERS)).add(np.full(len(ORDERS), 1.7976931348623157e308))
    overflowed = big.add(np.full(len(ORDERS), 1.7976931348623157e308))
    assert np.all(np.isinf(overflowed.finite))
    assert np.all(np.isposinf(_stored(overflowed.to_json())[0]))


def test_a_sum_stored_as_json_before_revision_0015_reads_the_same_and_a_broken_one_is_refused() -> None:
    rng = np.random.default_rng(7)
    s = RunningSum.empty(len(ORDERS)).add(random_curve(rng, infinite=True)).add(random_curve(rng, infinite=False))
    old = json.dumps({"finite": s.finite.tolist(), "infinite": s.infinite.tolist()})
    read = RunningSum.from_json(old)
    assert read.finite.tobytes() == s.finite.tobytes() and np.array_equal(read.infinite, s.infinite)
    text = RunningSum(s.finite, np.zeros(len(ORDERS), dtype=np.int64)).to_json()
    three_counts = ":" + base64.b64encode(np.ones(3, dtype="<i8").tobytes()).decode()
    for broken in ("not a sum", text[:-8], text.replace("b64:", "b64:!"), text + three_counts, '{"finite": [1.0]}'):
        with pytest.raises((ValueError, TypeError, KeyError)):
            RunningSum.from_json(broken)


def test_a_sum_written_here_is_read_back_without_parsing_and_equal_to_its_text() -> None:
    # An approval reads the sum the previous one wrote (running_sum._PARSED): what it gets must be
    # what parsing that text gives, and no reader may change it for the next one.
    rng = np.random.default_rng(11)
    s = RunningSum.empty(len(ORDERS)).add(random_curve(rng, infinite=True)).add(random_curve(rng, infinite=False))
    text = s.to_json()
    finite, infinite = _stored(text)  # the text, decoded independently
    kept = RunningSum.from_json(text)
    assert kept.finite.tobytes() == finite.tobytes()
    assert np.array_equal(kept.infinite, infinite)
    with pytest.raises(ValueError, match="read-only"):
        kept.finite[0] = 1.0
    # The writer's own arrays stay its own: changing them changes nothing read back from the text.
    s.finite[0] += 1.0
    assert RunningSum.from_json(text).finite[0] == finite[0]
    # A text this process never wrote (an edited row, another worker's write) is parsed as it reads.
    edited = RunningSum(finite * 2, infinite.copy()).to_json()
    running_sum._PARSED.clear()
    assert RunningSum.from_json(edited).finite.tobytes() == (finite * 2).tobytes()


def test_a_charge_curve_round_trips_through_json_with_infinities() -> None:
    curve = rdp.rdp_curve(PoissonSampled(sampling_rate=0.05, event=Gaussian(noise_multiplier=0.7)))
    assert np.any(np.isinf(curve))
    text = curve_to_json(curve)
    assert "Infinity" in text
    assert np.array_equal(curve_from_json(text), curve)
    tricky = np.array([0.0, 5e-324, 0.1 + 0.2, np.inf, 1e308])
    assert np.array_equal(curve_from_json(curve_to_json(tricky)), tricky)


# --- the per-leaf cache ---------------------------------------------------------------------------------


def test_a_repeated_dpsgd_pair_hits_the_cache_and_returns_an_unaliased_copy() -> None:
    # a (q, σ) no other test uses, so the first call is a miss
    first_mech = DpSgd(noise_multiplier=2.345, steps=100, sampling_rate=0.0123)
    before = rdp._leaf_curve_cached.cache_info()
    first = rdp.rdp_curve(first_mech)
    after_first = rdp._leaf_curve_cached.cache_info()
    assert after_first.misses == before.misses + 1

    second = rdp.rdp_curve(first_mech)
    after_second = rdp._leaf_curve_cached.cache_info()
    assert after_second.hits == after_first.hits + 1
    assert after_second.misses == after_first.misses
    assert np.array_equal(first, second)
    assert not np.shares_memory(first, second)

    # Mutating what a caller got must not change what the next caller gets.
    expected = second.copy()
    first[:] = -1.0
    second *= 1000
    third = rdp.rdp_curve(first_mech)
    assert np.array_equal(third, expected)

    # The cached entry is the step: other step counts, and the spelled-out step, share it.
    hits = rdp._leaf_curve_cached.cache_info().hits
    other = rdp.rdp_curve(DpSgd(noise_multiplier=2.345, steps=7, sampling_rate=0.0123))
    step = rdp.rdp_curve(PoissonSampled(sampling_rate=0.0123, event=Gaussian(noise_multiplier=2.345)))
    assert rdp._leaf_curve_cached.cache_info().hits == hits + 2
    assert np.array_equal(other, 7 * step)
    assert np.array_equal(third, 100 * step)


def test_a_leaf_curve_is_not_aliased_either() -> None:
    m = Laplace(noise_multiplier=3.21)
    a = rdp.rdp_curve(m)
    expected = a.copy()
    a[0] = np.inf
    b = rdp.rdp_curve(m)
    assert np.array_equal(b, expected)
    b[:] = 0
    assert np.array_equal(rdp.rdp_curve(m), expected)


def test_the_cached_curve_is_dp_accountings_curve() -> None:
    m = DpSgd(noise_multiplier=1.5, steps=100, sampling_rate=0.01)
    rdp.rdp_curve(m)  # from the cache from here on
    oracle = rdp_lib.RdpAccountant(orders=rdp_lib.DEFAULT_RDP_ORDERS)
    oracle.compose(to_dp_event(m))
    assert_curves_agree(rdp.rdp_curve(m), oracle.rdp)
    assert rdp.ORDERS == tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)


def test_a_curves_json_is_the_json_of_its_floats_whatever_its_layout_and_however_often() -> None:
    # curve_to_json keeps the JSON of each curve it wrote (keyed by its bytes): the text must stay
    # exactly json.dumps of the values, for a strided view, a -0.0, ∞ and an int array alike.
    base = np.array([0.0, -0.0, 1e-300, 0.1 + 0.2, np.inf, 2.5, 7.0, 1 / 3])
    for curve in (base, base[::2], base[::-1], np.arange(8), np.full(156, 0.1)):
        expected = json.dumps([float(x) for x in curve])
        assert curve_to_json(curve) == expected
        assert curve_to_json(curve) == expected  # the second time, from what was kept
        assert np.array_equal(curve_from_json(curve_to_json(curve)), curve.astype(float))
