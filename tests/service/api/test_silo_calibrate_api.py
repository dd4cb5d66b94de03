"""POST /v1/silos/{id}/calibrate: σ for what a silo has LEFT, checked against dp-accounting composing
the spent rounds and the planned ones by itself (converted by the silo's published filter,
tests/gate_oracle.py), and against the ledger then approving exactly them."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import rdp, reports
from dpledger.service.accounting.events import MechanismError
from dpledger.wire.mechanisms import DpSgd
from tests.conftest import ADMIN, bearer
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon

DELTA = 1e-5
BATCH, SIZE = 20, 1000  # q = 0.02


def dp_accounting_epsilon(*parts: tuple[float, int]) -> float:
    """dp-accounting composing (σ, steps) DP-SGD blocks at q = BATCH/SIZE, from an empty accountant."""
    accountant = rdp_lib.RdpAccountant()
    for sigma, steps in parts:
        accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(BATCH / SIZE, de.GaussianDpEvent(sigma)), steps))
    return float(accountant.get_epsilon(DELTA))


def gated_epsilon(client, silo, *parts: tuple[float, int]) -> float:  # type: ignore[no-untyped-def]
    """The same blocks through the silo's gate: dp-accounting's curves, its filter's conversion."""
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    curve = dpsgd_curve([(BATCH / SIZE, sigma, steps) for sigma, steps in parts])
    return proven_epsilon(filter_of(detail), curve, delta=DELTA)


def test_sigma_fits_what_is_left_and_the_ledger_then_approves_exactly_the_planned_rounds(client, make_silo) -> None:  # type: ignore[no-untyped-def]
    spent_step = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": 0.9, "steps": 50}
    silo = make_silo(epsilon=3.0, delta=DELTA, dataset_size=SIZE, horizon={**spent_step, "steps": 1})
    body = {"mechanism": spent_step, "idempotency_key": "before", "round": 0}
    assert client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers).status_code == 201

    rounds, steps = 4, 25
    plan = client.post(f"/v1/silos/{silo.id}/calibrate", json={"batch_size": BATCH, "steps_per_round": steps, "rounds": rounds},
                       headers=silo.headers)
    assert plan.status_code == 200, plan.text
    found = plan.json()
    sigma = found["noise_multiplier"]
    assert found["sampling_rate"] == BATCH / SIZE
    assert found["epsilon_spent"] == pytest.approx(gated_epsilon(client, silo, (0.9, 50)), rel=1e-9)
    assert found["epsilon_spent"] >= dp_accounting_epsilon((0.9, 50))  # the proven gate never reads less
    # The independent oracle: the spent block plus the planned rounds at σ fit; 1e-6 less noise does not.
    after = gated_epsilon(client, silo, (0.9, 50), *[(sigma, steps)] * rounds)
    assert after <= 3.0 and found["epsilon_after"] == pytest.approx(after, rel=1e-9)
    assert gated_epsilon(client, silo, (0.9, 50), *[(sigma * (1 - 2e-6), steps)] * rounds) > 3.0
    # More than a from-zero calibration would give: what was spent is accounted for.
    fresh = client.post("/v1/calibrate", json={"epsilon": 3.0, "delta": DELTA, "sampling_rate": BATCH / SIZE,
                                                "steps": rounds * steps}, headers=silo.headers).json()
    assert sigma > fresh["noise_multiplier"] * 1.01

    for r in range(rounds):
        mechanism = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": sigma, "steps": steps}
        answer = client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": mechanism, "idempotency_key": f"r{r}"},
                             headers=silo.headers)
        assert answer.status_code == 201, answer.text
    one_more = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": sigma, "steps": steps}
    assert client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": one_more, "idempotency_key": "over"},
                       headers=silo.headers).status_code == 409


def test_only_the_silo_and_admins_may_calibrate_and_bad_plans_are_422s(client, make_silo) -> None:  # type: ignore[no-untyped-def]
    silo, other = make_silo(dataset_size=SIZE), make_silo(dataset_size=SIZE)
    coordinator = client.post("/v1/keys", json={"role": "coordinator"}, headers=ADMIN).json()["api_key"]
    auditor = client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]
    plan = {"batch_size": BATCH, "steps_per_round": 10, "rounds": 2}
    path = f"/v1/silos/{silo.id}/calibrate"
    # A budget stays invisible: the coordinator and another silo are told the silo does not exist
    # (a 403 would tell them which ids do); an auditor, who reads every silo, is refused.
    assert client.post(path, json=plan, headers=bearer(coordinator)).status_code == 404
    assert client.post(path, json=plan, headers=other.headers).status_code == 404
    assert client.post(path, json=plan, headers=bearer(auditor)).status_code == 403
    assert client.post(path, json=plan, headers=ADMIN).status_code == 200
    too_big = client.post(path, json={**plan, "batch_size": SIZE + 1}, headers=silo.headers)
    assert too_big.status_code == 422 and too_big.json()["detail"][0]["loc"] == ["body", "batch_size"]
    raw_rate = client.post(path, json={**plan, "sampling_rate": 0.1}, headers=silo.headers)
    assert raw_rate.status_code == 422  # q comes from the registered size only


def test_a_nearly_spent_silo_gets_large_noise_and_an_overspent_curve_nothing(client, make_silo) -> None:  # type: ignore[no-untyped-def]
    step_of_30 = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": 1.0, "steps": 30}
    silo = make_silo(epsilon=0.5, delta=DELTA, dataset_size=SIZE, horizon=step_of_30)
    # A first charge first (it may refit the registered filter), then the rest calibrated to all that is left.
    first = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": 4.0, "steps": 30}
    assert client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": first, "idempotency_key": "first"},
                       headers=silo.headers).status_code == 201
    sigma = client.post(f"/v1/silos/{silo.id}/calibrate", json={"batch_size": BATCH, "steps_per_round": 30, "rounds": 1},
                        headers=silo.headers).json()["noise_multiplier"]
    step = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": sigma, "steps": 30}
    assert client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": step, "idempotency_key": "exact"},
                       headers=silo.headers).status_code == 201
    answer = client.post(f"/v1/silos/{silo.id}/calibrate", json={"batch_size": BATCH, "steps_per_round": 1, "rounds": 1},
                         headers=silo.headers)
    assert answer.status_code == 200 and answer.json()["epsilon_after"] <= 0.5
    assert answer.json()["noise_multiplier"] > 20 * sigma  # next to nothing is left
    # A curve already over the budget (the ledger never stores one; a lowered budget would) plans nothing.
    spent = rdp.rdp_curve(DpSgd(sampling_rate=BATCH / SIZE, noise_multiplier=0.5, steps=500))
    with pytest.raises(MechanismError) as error:
        reports.calibrate_remaining(spent, budget=0.5, sampling_rate=BATCH / SIZE, steps=1,
                                   epsilon_of=lambda curve: rdp.epsilon(curve, delta=DELTA)[0])
    assert error.value.field == "rounds"
