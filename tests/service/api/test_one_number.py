"""Issue 46, item 4: one number everywhere. A rounds quote is what the gate then approves one by one
(a plan's silo on and off its plan, a filter fixed by the first charge, a search in between); a
quote's `epsilon_plan` with `silo_id` is what the silo would store; dp-accounting's reference beside
every ε an answer states; no registration is a 500."""

from __future__ import annotations

from typing import Any

import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient

from tests.conftest import ADMIN

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}
TRIAL = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 3.0, "steps": 1}
SEARCH = {"type": "repeat_and_select", "mean": 2.0, "shape": 1.0, "event": TRIAL}  # what a geometric search charges


def dp_accounting_epsilon(*events: tuple[float, float, int], delta: float = 1e-5) -> float:
    """dp-accounting's own RDP ε of Poisson-sampled Gaussian steps (q, σ, steps), composed."""
    accountant = rdp_lib.RdpAccountant()
    for q, sigma, steps in events:
        accountant.compose(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), steps)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize("epsilon", [1e-12, 1e-100, 1e-300, 1e-3, 1.0])
@pytest.mark.parametrize("delta", [1e-5, 0.999])
def test_a_registration_is_201_or_a_422_naming_the_field_never_a_500(client: TestClient, epsilon: float, delta: float) -> None:
    body = {"name": f"tiny-{epsilon}-{delta}", "epsilon": epsilon, "delta": delta, "dataset_size": 1000}
    answer = client.post("/v1/silos", json=body, headers=ADMIN)
    assert answer.status_code in (201, 422), answer.text
    if answer.status_code == 422:
        detail = answer.json()["detail"][0]
        assert detail["loc"] == ["body", "delta" if delta >= 0.5 else "epsilon"]
        assert "declare a horizon" in detail["msg"] or "δ well below 1/n" in detail["msg"]
        assert client.get("/v1/silos", headers=ADMIN).json() == []  # nothing written
    else:
        assert (epsilon, delta) in ((1.0, 1e-5),)


def approve_one_by_one(client: TestClient, silo: Any, rounds: list[dict[str, Any]]) -> int:
    """The rounds charged in order (a search's round through the search route), until one is refused."""
    for index, mechanism in enumerate(rounds):
        if mechanism is SEARCH:
            body = {"trial": TRIAL, "mean_trials": 2.0, "distribution": {"kind": "geometric"}, "idempotency_key": f"s{index}"}
            answer = client.post(f"/v1/silos/{silo.id}/searches", json=body, headers=silo.headers)
        else:
            body = {"mechanism": mechanism, "idempotency_key": f"r{index}", "round": index}
            answer = client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers)
        if answer.status_code == 409:
            return index
        assert answer.status_code == 201, answer.text
    return len(rounds)


def test_a_planned_silos_rounds_quote_is_what_the_gate_approves_on_and_off_the_plan(
    client: TestClient, make_silo: Any,
) -> None:
    # Was 1,264 quoted and 1,163 approved at ε = 2: the first charge fixed the filter on δ/4 (scaled twice).
    # A silo with no horizon: its filter is fixed by the first charge, the plan's first unit.
    silo = make_silo(epsilon=1.0, horizon=None)
    plan = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": STEP | {"steps": 5}}, headers=silo.headers)
    assert plan.status_code == 201, plan.text
    runs = [{"mechanism": STEP, "count": 5}, {"mechanism": SEARCH, "count": 1}, {"mechanism": STEP, "count": 200}]
    quoted = client.post("/v1/quote/rounds", json={"silo_id": silo.id, "rounds": 1, "runs": runs}, headers=silo.headers)
    assert quoted.status_code == 200, quoted.text
    affordable = quoted.json()["affordable_rounds"]
    assert 6 < affordable < 206
    rounds = [run["mechanism"] for run in runs for _ in range(run["count"])]
    assert approve_one_by_one(client, silo, rounds) == affordable


def test_epsilon_plan_with_silo_id_is_what_the_silo_would_store(client: TestClient, make_silo: Any) -> None:
    plan = {"type": "self_composed", "count": 5, "event": {"type": "gaussian", "noise_multiplier": 5.0}}
    for horizon in (None, STEP):
        silo = make_silo(epsilon=5.0, horizon=horizon)
        quoted = client.post("/v1/quote", json={"mechanism": plan, "silo_id": silo.id}, headers=silo.headers).json()
        declared = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": plan}, headers=silo.headers).json()
        assert quoted["epsilon_plan"] == declared["epsilon"]  # on the plan's half of δ, as stored


def test_dp_accountings_reference_is_beside_every_stated_epsilon(client: TestClient, make_silo: Any) -> None:
    silo = make_silo(epsilon=50.0)
    q = 10 / 1000
    one, two = dp_accounting_epsilon((q, 1.1, 1)), dp_accounting_epsilon((q, 1.1, 2))

    def reserve(key: str) -> Any:
        return client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": STEP, "idempotency_key": key},
                           headers=silo.headers)

    approved = reserve("a")
    assert approved.status_code == 201 and approved.json()["epsilon_dp_accounting"] == pytest.approx(one, rel=1e-9)
    replay = reserve("a")
    assert replay.status_code == 200 and replay.json()["epsilon_dp_accounting"] == pytest.approx(one, rel=1e-9)
    charge_id = approved.json()["charge_id"]
    committed = client.post(f"/v1/charges/{charge_id}/commit", headers=silo.headers).json()
    assert committed["epsilon_dp_accounting"] == pytest.approx(one, rel=1e-9)
    assert reserve("b").json()["epsilon_dp_accounting"] == pytest.approx(two, rel=1e-9)
    read = client.get(f"/v1/charges/{charge_id}", headers=silo.headers).json()
    listed = client.get(f"/v1/silos/{silo.id}/charges", headers=silo.headers).json()
    silos_listed = client.get("/v1/silos", headers=ADMIN).json()
    for answer in (read, *listed, *silos_listed):
        assert answer["epsilon_dp_accounting"] == pytest.approx(two, rel=1e-9)
        assert answer["epsilon_spent"] >= answer["epsilon_dp_accounting"]  # the gate's proven reading, never less
    quoted = client.post("/v1/quote", json={"mechanism": STEP, "silo_id": silo.id}, headers=silo.headers).json()
    assert quoted["silo_epsilon_spent_dp_accounting"] == pytest.approx(two, rel=1e-9)
    three = dp_accounting_epsilon((q, 1.1, 3))
    assert quoted["epsilon_if_approved_dp_accounting"] == pytest.approx(three, rel=1e-9)
    calibrated = client.post(f"/v1/silos/{silo.id}/calibrate", json={"batch_size": 10, "steps_per_round": 1, "rounds": 5},
                             headers=silo.headers).json()
    assert calibrated["epsilon_spent_dp_accounting"] == pytest.approx(two, rel=1e-9)
    sigma = calibrated["noise_multiplier"]
    after = dp_accounting_epsilon((q, 1.1, 2), (q, sigma, 5))
    # The ledger's curves are certified at fractional orders (a hair tighter than dp-accounting's own there).
    assert calibrated["epsilon_after_dp_accounting"] == pytest.approx(after, rel=1e-4)
