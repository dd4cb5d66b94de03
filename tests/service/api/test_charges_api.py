"""Approval, settlement and idempotency through the real app, against dp-accounting's own numbers
converted by the silo's published filter (tests/gate_oracle.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from tests.conftest import ADMIN
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon
from tests.service.api.answers import gained_or_kept_inclusion, without_inclusion

Q, SIGMA = 0.01, 1.1
STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": SIGMA, "steps": 1}  # dataset_size 1000 → q = 0.01


def dp_accounting_epsilon(rounds: int, *, delta: float = 1e-5, steps: int = 1) -> float:
    """The independent oracle: dp-accounting composing `rounds` DP-SGD steps by itself."""
    accountant = rdp_lib.RdpAccountant()
    for _ in range(rounds):
        accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(SIGMA)), steps))
    return accountant.get_epsilon(delta)


def proven(client, silo, rounds: int, *, steps: int = 1) -> float:  # type: ignore[no-untyped-def]
    """The silo's gate on `rounds` × `steps` DP-SGD steps: dp-accounting's curve, its filter's conversion."""
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    return proven_epsilon(filter_of(detail), dpsgd_curve([(Q, SIGMA, rounds * steps)]), delta=silo.delta)


def charge(client, silo, key: str, mechanism=None, **extra):  # type: ignore[no-untyped-def]
    body = {"mechanism": mechanism or STEP, "idempotency_key": key, **extra}
    return client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers)


def history_length(client, silo) -> int:  # type: ignore[no-untyped-def]
    return len(client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json())


def test_a_budget_that_admits_exactly_k_rounds_approves_k_and_refuses_the_next(client, make_silo) -> None:
    silo = make_silo(epsilon=dp_accounting_epsilon(7) * 1.02)
    k = max(r for r in range(1, 50) if proven(client, silo, r) <= silo.epsilon)
    assert k >= 5 and proven(client, silo, k + 1) > silo.epsilon
    for i in range(k):
        response = charge(client, silo, f"r{i}")
        assert response.status_code == 201, response.text
        assert response.json()["epsilon_spent"] == pytest.approx(proven(client, silo, i + 1), rel=1e-9)
    entries = history_length(client, silo)

    refused = charge(client, silo, "one-too-many")

    assert refused.status_code == 409
    body = refused.json()
    assert body["epsilon"] == silo.epsilon
    assert body["epsilon_spent"] == pytest.approx(proven(client, silo, k), rel=1e-9)
    assert body["epsilon_if_approved"] == pytest.approx(proven(client, silo, k + 1), rel=1e-9)
    assert history_length(client, silo) == entries  # a refused request writes nothing


def test_the_gate_costs_a_little_more_than_the_unproven_rule_never_less(client, make_silo) -> None:
    silo = make_silo(epsilon=dp_accounting_epsilon(1, steps=20) * 1.05)
    assert charge(client, silo, "a", mechanism={**STEP, "steps": 20}).status_code == 201
    spent = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()["epsilon_spent"]
    # The old rule's ε (some order of 156, each with the whole δ) is below the proven one; the union
    # bound over the silo's committed order costs a few percent at most on its own horizon.
    assert dp_accounting_epsilon(1, steps=20) <= spent <= dp_accounting_epsilon(1, steps=20) * 1.05


def test_release_returns_the_reservation_and_commit_keeps_it(client, make_silo) -> None:
    probe = make_silo(epsilon=dp_accounting_epsilon(2) * 1.01)
    silo = make_silo(epsilon=(proven(client, probe, 2) + proven(client, probe, 3)) / 2)
    assert proven(client, silo, 2) <= silo.epsilon < proven(client, silo, 3)
    first = charge(client, silo, "a").json()["charge_id"]
    second = charge(client, silo, "b").json()["charge_id"]
    assert charge(client, silo, "c").status_code == 409

    committed = client.post(f"/v1/charges/{first}/commit", headers=silo.headers)
    released = client.post(f"/v1/charges/{second}/release", headers=silo.headers)

    assert committed.status_code == 200 and committed.json()["status"] == "committed"
    assert released.status_code == 200 and released.json()["status"] == "released"
    assert released.json()["epsilon_spent"] == pytest.approx(proven(client, silo, 1), rel=1e-9)
    detail = client.get(f"/v1/silos/{silo.id}", headers=silo.headers).json()
    assert detail["epsilon_spent"] == pytest.approx(proven(client, silo, 1), rel=1e-9)
    assert detail["epsilon_committed"] == pytest.approx(proven(client, silo, 1), rel=1e-9)
    assert detail["epsilon_remaining"] == pytest.approx(silo.epsilon - proven(client, silo, 1), rel=1e-9)
    assert charge(client, silo, "c").status_code == 201  # the released budget is spendable again


def test_settling_twice_or_commit_after_release_is_a_conflict(client, make_silo) -> None:
    silo = make_silo(epsilon=5.0)
    a = charge(client, silo, "a").json()["charge_id"]
    b = charge(client, silo, "b").json()["charge_id"]
    assert client.post(f"/v1/charges/{a}/commit", headers=silo.headers).status_code == 200
    assert client.post(f"/v1/charges/{b}/release", headers=silo.headers).status_code == 200
    entries = history_length(client, silo)

    for path in (f"/v1/charges/{a}/commit", f"/v1/charges/{a}/release", f"/v1/charges/{b}/commit", f"/v1/charges/{b}/release"):
        response = client.post(path, headers=silo.headers)
        assert response.status_code == 409, path
        assert "not reserved" in response.json()["detail"]
        assert response.json()["charge_status"] in ("committed", "released")
    assert history_length(client, silo) == entries
    assert client.post("/v1/charges/999999/commit", headers=silo.headers).status_code == 404


def test_a_retry_returns_the_first_answer_and_charges_once(client, make_silo) -> None:
    silo = make_silo()
    first = charge(client, silo, "same", job_id="job", round=3)
    retry = charge(client, silo, "same", job_id="job", round=3)

    assert first.status_code == 201 and retry.status_code == 200  # only a fresh reservation is a 201
    assert without_inclusion(retry.json()) == without_inclusion({**first.json(), "replayed": True})
    assert gained_or_kept_inclusion(first.json(), retry.json())
    assert first.json()["status"] == "reserved" and first.json()["replayed"] is False
    assert retry.headers["Idempotent-Replayed"] == "true"
    detail = client.get(f"/v1/silos/{silo.id}", headers=silo.headers).json()
    assert detail["epsilon_spent"] == pytest.approx(proven(client, silo, 1), rel=1e-9)


def test_the_same_key_with_another_body_is_refused_and_writes_nothing(client, make_silo) -> None:
    silo = make_silo()
    assert charge(client, silo, "k").status_code == 201
    entries = history_length(client, silo)

    response = charge(client, silo, "k", mechanism={**STEP, "steps": 2})

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "idempotency_key"]
    assert history_length(client, silo) == entries


def test_the_service_derives_q_from_the_registered_dataset_size(client, make_silo) -> None:
    silo = make_silo(dataset_size=1000)
    assert charge(client, silo, "a", mechanism={**STEP, "batch_size": 10}).status_code == 201
    stored = client.get(f"/v1/silos/{silo.id}/history", headers=silo.headers).json()[-1]["mechanism"]
    assert stored["sampling_rate"] == 10 / 1000

    lying = charge(client, silo, "b", mechanism={**STEP, "batch_size": 10, "sampling_rate": 0.001})
    assert lying.status_code == 422
    assert lying.json()["detail"][0]["loc"] == ["body", "mechanism", "sampling_rate"]
    nested = {"type": "repeat_and_select", "mean": 3, "shape": 1, "event": {**STEP, "batch_size": 2000}}
    too_big = charge(client, silo, "c", mechanism=nested)
    assert too_big.status_code == 422
    assert too_big.json()["detail"][0]["loc"] == ["body", "mechanism", "event", "batch_size"]


def test_epsilon_spent_equals_dp_accounting_over_a_mixed_history(client, make_silo) -> None:
    silo = make_silo(epsilon=50.0, delta=1e-6)
    mechanisms = [
        STEP,
        {"type": "gaussian", "noise_multiplier": 4.0},
        {"type": "zcdp", "rho": 0.01},
        {"type": "laplace", "noise_multiplier": 10.0},
        {"type": "poisson_sampled", "expected_batch_size": 50, "event": {"type": "gaussian", "noise_multiplier": 2.0}},
        {"type": "repeat_and_select", "mean": 5, "shape": "infinity", "event": {"type": "gaussian", "noise_multiplier": 8.0}},
        {**STEP, "steps": 30},
    ]
    events = [
        de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(SIGMA)), 1),
        de.GaussianDpEvent(4.0),
        de.ZCDpEvent(0.01),
        de.LaplaceDpEvent(10.0),
        de.PoissonSampledDpEvent(0.05, de.GaussianDpEvent(2.0)),
        de.RepeatAndSelectDpEvent(de.GaussianDpEvent(8.0), 5, math.inf),
        de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(SIGMA)), 30),
    ]
    ids = [charge(client, silo, f"m{i}", mechanism=m).json()["charge_id"] for i, m in enumerate(mechanisms)]
    client.post(f"/v1/charges/{ids[1]}/release", headers=silo.headers)
    client.post(f"/v1/charges/{ids[0]}/commit", headers=silo.headers)

    # dp-accounting's curves; the Poisson-sampled Gaussians' (0, 4, 6) through the oracle's certified
    # fractional orders, as the ledger charges them.
    others = rdp_lib.RdpAccountant()
    others.compose(de.ComposedDpEvent([events[2], events[3], events[5]]))
    spent_curve = others.rdp + dpsgd_curve([(Q, SIGMA, 31), (0.05, 2.0, 1)])
    detail = client.get(f"/v1/silos/{silo.id}", headers=silo.headers).json()
    assert detail["epsilon_spent"] == pytest.approx(proven_epsilon(filter_of(detail), spent_curve, delta=1e-6), rel=1e-9)
    committed = proven_epsilon(filter_of(detail), dpsgd_curve([(Q, SIGMA, 1)]), delta=1e-6)
    assert detail["epsilon_committed"] == pytest.approx(committed, rel=1e-9)
    assert detail["rho"] == pytest.approx(float(max(spent_curve / others.orders)), rel=1e-9)

    # Beside the gate's reading, for reference: dp-accounting's non-adaptive conversion of the same
    # curve, in the silo's detail and after each entry of its history (a release takes its charge back).
    def reference(curve: np.ndarray) -> float:
        return float(rdp_lib.compute_epsilon(others.orders, curve, 1e-6)[0])

    assert detail["epsilon_dp_accounting"] == pytest.approx(reference(spent_curve), rel=1e-9)
    history = client.get(f"/v1/silos/{silo.id}/history", headers=silo.headers).json()
    charged = [e for e in history if e["event"] in ("reserve", "release")]
    curves = [dpsgd_curve([(Q, SIGMA, 1)])]
    for event in events[1:4] + events[5:6]:
        alone = rdp_lib.RdpAccountant()
        alone.compose(event)
        curves.append(alone.rdp)
    curves.insert(4, dpsgd_curve([(0.05, 2.0, 1)]))
    curves.append(dpsgd_curve([(Q, SIGMA, 30)]))
    running = np.zeros_like(spent_curve)
    for entry in charged:
        index = ids.index(entry["charge_id"])
        running = running + curves[index] if entry["event"] == "reserve" else running - curves[index]
        assert entry["epsilon_dp_accounting"] == pytest.approx(reference(running), rel=1e-9, abs=1e-12)
    assert running == pytest.approx(spent_curve, rel=1e-12)


def test_quote_matches_dp_accounting_and_previews_the_silo(client, make_silo) -> None:
    silo = make_silo()
    charge(client, silo, "a")

    alone = client.post("/v1/quote", json={"mechanism": {**STEP, "steps": 50}, "silo_id": silo.id}, headers=silo.headers).json()
    # The mechanism alone: dp-accounting's ε, on the ledger's curve (certified at fractional orders,
    # which moves it by less than 1e-8 here).
    assert alone["epsilon"] == pytest.approx(dp_accounting_epsilon(1, steps=50), rel=1e-8)
    assert alone["epsilon"] <= dp_accounting_epsilon(1, steps=50)
    assert alone["silo_epsilon_spent"] == pytest.approx(proven(client, silo, 1), rel=1e-9)
    assert alone["epsilon_if_approved"] == pytest.approx(proven(client, silo, 51), rel=1e-9)
    assert alone["epsilon_pld"] < alone["epsilon"]  # PLD is the tighter accountant

    zcdp = client.post("/v1/quote", json={"mechanism": {"type": "zcdp", "rho": 0.1}, "delta": 1e-5}, headers=ADMIN).json()
    assert zcdp["epsilon_pld"] is None and "ZCDpEvent" in zcdp["pld_note"]
    no_delta = client.post("/v1/quote", json={"mechanism": {"type": "zcdp", "rho": 0.1}}, headers=ADMIN)
    assert no_delta.status_code == 422 and no_delta.json()["detail"][0]["loc"] == ["body", "delta"]


def test_calibrate_returns_noise_within_the_target(client) -> None:
    response = client.post(
        "/v1/calibrate", json={"epsilon": 2.0, "delta": 1e-5, "sampling_rate": 0.01, "steps": 500}, headers=ADMIN
    )
    assert response.status_code == 200
    sigma = response.json()["noise_multiplier"]
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(sigma)), 500))
    assert accountant.get_epsilon(1e-5) <= 2.0
    tighter = rdp_lib.RdpAccountant()
    tighter.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(sigma * 0.999)), 500))
    assert tighter.get_epsilon(1e-5) > 2.0
