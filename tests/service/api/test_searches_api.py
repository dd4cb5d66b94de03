"""Private hyperparameter searches (Liu et al. 2022 §7; Papernot & Steinke 2022) through the real app,
against dp-accounting's own RepeatAndSelectDpEvent, plus the law of the K the service draws."""

from __future__ import annotations

import math
import random
import secrets

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import stats

from dpledger.service.accounting import rdp, trial_counts
from dpledger.service.accounting.trial_counts import distribution, draw_trials
from dpledger.wire.mechanisms import Laplace, RepeatAndSelect
from tests.conftest import ADMIN
from tests.gate_oracle import filter_of, proven_epsilon
from tests.service.api.answers import gained_or_kept_inclusion, without_inclusion

Q, SIGMA, STEPS = 0.01, 1.1, 10
TRIAL = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": SIGMA, "steps": STEPS}  # dataset_size 1000 → q = 0.01
LAWS = [
    ("poisson", None, math.inf),
    ("geometric", None, 1.0),
    ("logarithmic", None, 0.0),
    ("truncated_negative_binomial", 0.5, 0.5),
]


def trial_event() -> de.DpEvent:
    return de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(SIGMA)), STEPS)


def oracle_epsilon(mean: float, shape: float, *, delta: float = 1e-5) -> float:
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.RepeatAndSelectDpEvent(trial_event(), mean, shape))
    return float(accountant.get_epsilon(delta))


def gated_epsilon(client, silo, mean: float, shape: float) -> float:  # type: ignore[no-untyped-def]
    """dp-accounting's repeat-and-select curve, converted by the silo's published filter."""
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.RepeatAndSelectDpEvent(trial_event(), mean, shape))
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    return proven_epsilon(filter_of(detail), accountant.rdp, delta=silo.delta)


def start(client, silo, key: str, *, kind: str = "geometric", shape: float | None = None, mean: float = 10, trial=None):  # type: ignore[no-untyped-def]
    law: dict[str, object] = {"kind": kind} if shape is None else {"kind": kind, "shape": shape}
    body = {"trial": trial or TRIAL, "mean_trials": mean, "distribution": law, "idempotency_key": key}
    return client.post(f"/v1/silos/{silo.id}/searches", json=body, headers=silo.headers)


def events(client, silo) -> list[str]:  # type: ignore[no-untyped-def]
    return [e["event"] for e in client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()]


@pytest.mark.parametrize(("kind", "shape", "shape_value"), LAWS)
def test_a_search_is_charged_exactly_dp_accountings_repeat_and_select(client, make_silo, kind, shape, shape_value) -> None:
    silo = make_silo(epsilon=100.0)

    response = start(client, silo, f"search-{kind}", kind=kind, shape=shape)

    assert response.status_code == 201, response.text
    charged = response.json()["epsilon_spent"]
    expected = gated_epsilon(client, silo, 10, shape_value)
    assert abs(charged - expected) <= 1e-9 * expected
    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    assert history[-1]["mechanism"]["type"] == "repeat_and_select"
    assert history[-1]["mechanism"]["shape"] == ("infinity" if shape_value == math.inf else shape_value)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 3.0])
def test_a_pure_dp_trial_costs_at_most_two_plus_eta_epsilon_and_approaches_it(eta: float) -> None:
    """Papernot & Steinke, Thm 2 with ε̂ = ε: an ε-DP trial gives a (2+η)ε-DP search. On a finite
    order grid the bound carries the slack of the largest order λ̂ = λ_max, so we assert, at every
    order λ, RDP(λ) ≤ (2+η)ε + ln(E[K])/(λ−1) + (1+η)·ln(1/γ)/λ_max, and that at λ_max the curve is
    within 3% of (2+η)ε (the bound is attained as λ → ∞)."""
    eps0, mean = 1.0, 10.0
    law = distribution("logarithmic" if eta == 0 else "geometric" if eta == 1 else "truncated_negative_binomial", mean=mean,
                       shape=None if eta in (0.0, 1.0) else eta)
    curve = rdp.rdp_curve(RepeatAndSelect(event=Laplace(noise_multiplier=1 / eps0), mean=mean, shape=eta))
    orders = np.array(rdp.ORDERS)
    gamma = law.gamma
    assert gamma is not None
    slack = np.log(mean) / (orders - 1) + (1 + eta) * math.log(1 / gamma) / orders.max()
    pure = (2 + eta) * eps0
    finite = orders > 1
    assert np.all(curve[finite] <= pure + slack[finite] + 1e-12)
    assert abs(curve[-1] - pure) <= 0.03 * pure


@pytest.mark.parametrize(("kind", "shape"), [(k, s) for k, s, _ in LAWS] + [("truncated_negative_binomial", 2.0)])
@pytest.mark.parametrize("mean", [1.5, 10.0])
def test_the_drawn_number_of_trials_follows_its_distribution(kind: str, shape: float | None, mean: float) -> None:
    """Chi-square goodness of fit of 20,000 draws against the exact pmf, at α = 1e-4 (fixed seeds:
    the test is deterministic; the seeds were not chosen to pass). Cells with expected count < 5 are
    pooled into the tail, so the χ² approximation holds."""
    law = distribution(kind, mean=mean, shape=shape)  # type: ignore[arg-type]
    rng = random.Random(20_240_501)
    n = 20_000
    draws = np.array([draw_trials(law, rng=rng) for _ in range(n)])
    start_k = 0 if kind == "poisson" else 1
    assert draws.min() >= start_k
    probabilities, k = [], start_k
    while n * law.pmf(k) >= 5 or k < start_k + 1:
        probabilities.append(law.pmf(k))
        k += 1
    observed = [int(np.sum(draws == j)) for j in range(start_k, k)] + [int(np.sum(draws >= k))]
    expected = [n * p for p in probabilities] + [n * (1 - sum(probabilities))]
    if expected[-1] < 5:  # pool a too-thin tail into the last cell
        tail_observed, tail_expected = observed.pop(), expected.pop()
        observed[-1] += tail_observed
        expected[-1] += tail_expected
    result = stats.chisquare(observed, expected)
    assert result.pvalue > 1e-4, (observed, expected)
    assert abs(draws.mean() - mean) < 6 * draws.std() / math.sqrt(n)


def test_draws_are_cryptographic_by_default() -> None:
    assert isinstance(trial_counts._SYSTEM_RANDOM, secrets.SystemRandom)
    law = distribution("poisson", mean=10)
    assert all(draw_trials(law) >= 0 for _ in range(100))
    assert draw_trials(distribution("geometric", mean=1)) == 1  # mean 1: K = 1 surely


def test_a_search_over_budget_is_refused_before_any_trial_and_writes_nothing(client, make_silo) -> None:
    silo = make_silo(epsilon=oracle_epsilon(10, 1.0) * 0.99)
    before = events(client, silo)

    refused = start(client, silo, "too-big")

    assert refused.status_code == 409
    body = refused.json()
    assert body["epsilon_if_approved"] == pytest.approx(gated_epsilon(client, silo, 10, 1.0), rel=1e-9)
    assert "trials" not in body and "search_id" not in body  # no K was drawn, nothing can run
    assert events(client, silo) == before
    assert client.get("/v1/searches/1", headers=ADMIN).status_code == 404


def test_trials_up_to_k_are_accepted_the_kth_commits_and_one_more_is_refused(client, make_silo) -> None:
    silo = make_silo(epsilon=100.0)
    answer = start(client, silo, "s", mean=3)
    assert answer.status_code == 201, answer.text
    started = answer.json()
    search_id, k, charge_id = started["search_id"], started["trials"], started["charge_id"]
    assert k >= 1  # geometric: K ≥ 1
    refused = client.post(f"/v1/charges/{charge_id}/release", headers=silo.headers)
    assert refused.status_code == 409 and "hyperparameter search" in refused.json()["detail"]

    scores = [0.1 * (i % 4) for i in range(k)]
    for i, score in enumerate(scores):
        assert events(client, silo)[-1] == "reserve"  # not committed before the K-th trial
        reported = client.post(f"/v1/searches/{search_id}/trials", json={"score": score}, headers=silo.headers)
        assert reported.status_code == 200, reported.text
        assert reported.json()["trials_reported"] == i + 1

    assert events(client, silo)[-2:] == ["reserve", "commit"]
    detail = client.get(f"/v1/searches/{search_id}", headers=silo.headers).json()
    assert detail["status"] == "done" and detail["best_score"] == max(scores) and detail["charge_id"] == charge_id
    entries = events(client, silo)

    extra = client.post(f"/v1/searches/{search_id}/trials", json={"score": 1.0}, headers=silo.headers)

    assert extra.status_code == 409
    assert extra.json() == {"detail": f"search {search_id} drew K={k} trials and all were reported; no more may run"}
    assert events(client, silo) == entries
    assert client.get(f"/v1/searches/{search_id}", headers=silo.headers).json()["trials_reported"] == k


def test_a_retried_start_returns_the_same_search_and_k(client, make_silo) -> None:
    silo = make_silo(epsilon=100.0)
    first = start(client, silo, "same", kind="poisson")
    again = start(client, silo, "same", kind="poisson")
    assert first.status_code == 201
    assert again.status_code == 200 and again.headers.get("Idempotent-Replayed") == "true"
    assert without_inclusion(again.json()) == without_inclusion(first.json())
    assert gained_or_kept_inclusion(first.json(), again.json())
    assert events(client, silo).count("reserve") == 1


def test_a_shape_is_only_for_the_truncated_negative_binomial(client, make_silo) -> None:
    silo = make_silo(epsilon=100.0)
    assert start(client, silo, "a", kind="geometric", shape=2.0).status_code == 422
    assert start(client, silo, "b", kind="truncated_negative_binomial").status_code == 422
    assert events(client, silo) == ["create"]


def test_the_quote_puts_the_naive_search_beside_each_random_one(client, make_silo) -> None:
    trial = {"type": "dpsgd", "sampling_rate": Q, "noise_multiplier": SIGMA, "steps": STEPS}
    body = {"trial": trial, "mean_trials": 10, "delta": 1e-5, "tnb_shapes": [0.5, 2.0]}

    response = client.post("/v1/searches/quote", json=body, headers=ADMIN)

    assert response.status_code == 200, response.text
    quote = response.json()
    naive = rdp_lib.RdpAccountant()
    naive.compose(de.SelfComposedDpEvent(trial_event(), 10))
    assert quote["naive_grid_size"] == 10
    # The ledger's curves are certified at fractional orders: below dp-accounting's by < 1e-8 here.
    assert quote["naive_epsilon"] == pytest.approx(naive.get_epsilon(1e-5), rel=1e-8)
    got = {(d["kind"], d["shape"]): d["epsilon"] for d in quote["distributions"]}
    for (kind, shape), eps in got.items():
        value = math.inf if shape == "infinity" else float(shape)
        assert eps == pytest.approx(oracle_epsilon(10, value), rel=1e-9), kind
    assert len(got) == 5
