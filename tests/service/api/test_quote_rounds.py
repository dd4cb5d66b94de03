"""POST /v1/quote/rounds: a job's rounds priced in one request. The rounds it says a budget buys are
the rounds the gate then approves one reservation at a time; bad input is a 422 naming the field and
writes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from fastapi.testclient import TestClient

from tests.conftest import ADMIN

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 3}
SELECT = {"type": "gaussian", "noise_multiplier": 4.0}


def quote(client: TestClient, headers: dict[str, str], **body: Any) -> Any:
    return client.post("/v1/quote/rounds", json=body, headers=headers)


def dp_accounting_epsilon(*, rounds: int) -> float:
    """dp-accounting's RDP ε at δ 1e-5 of the test's first `rounds` rounds (two DP-SGD rounds, then a
    selection), on a silo of 1,000 records."""
    accountant = rdp_lib.RdpAccountant()
    for index in range(rounds):
        if index % 3 == 2:
            accountant.compose(de.GaussianDpEvent(SELECT["noise_multiplier"]))
        else:
            accountant.compose(de.PoissonSampledDpEvent(10 / 1000, de.GaussianDpEvent(1.1)), 3)
    return float(accountant.get_epsilon(1e-5))


def test_the_rounds_it_says_a_budget_buys_are_the_rounds_the_gate_approves(client: TestClient, make_silo: Any) -> None:
    silo = make_silo(epsilon=2.0)
    # A round with a selection query every third round, then two rounds that read nothing.
    runs = [{"mechanism": STEP, "count": 2}, {"mechanism": SELECT, "count": 1}] * 20 + [{"mechanism": None, "count": 2}]
    answer = quote(client, silo.headers, silo_id=silo.id, rounds=10, runs=runs)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["horizon"] == 62 and 0 < body["affordable_rounds"] < 60
    assert (body["epsilon"], body["delta"], body["epsilon_spent"]) == (2.0, 1e-5, 0.0)
    # Beside each of the gate's readings, dp-accounting's own non-adaptive ε of the same charges.
    assert body["epsilon_spent_dp_accounting"] == 0.0
    assert body["epsilon_after_first_round_dp_accounting"] == pytest.approx(dp_accounting_epsilon(rounds=1), rel=1e-6)
    assert body["epsilon_after_rounds_dp_accounting"] == pytest.approx(dp_accounting_epsilon(rounds=10), rel=1e-6)
    assert body["epsilon_after_first_round"] >= body["epsilon_after_first_round_dp_accounting"]

    rounds = [run["mechanism"] for run in runs for _ in range(run["count"])]
    approved = 0
    for index, mechanism in enumerate(rounds):
        if mechanism is None:
            approved += 1
            continue
        reserved = client.post(f"/v1/silos/{silo.id}/charges", headers=silo.headers,
                               json={"mechanism": mechanism, "idempotency_key": f"r{index}", "round": index})
        if reserved.status_code == 409:
            break
        assert reserved.status_code == 201, reserved.text
        approved += 1
        if index == 0:  # what the quote said the job's first round leaves, the ledger states
            assert reserved.json()["epsilon_spent"] == body["epsilon_after_first_round"]
        if index == 9:  # the job's 10 rounds: the ε the quote said they leave
            assert reserved.json()["epsilon_spent"] == body["epsilon_after_rounds"]
    assert approved == body["affordable_rounds"]
    # Asked again now, the spent budget buys nothing more of the same.
    again = quote(client, silo.headers, silo_id=silo.id, rounds=1, runs=[{"mechanism": rounds[approved], "count": 1}]).json()
    assert again["affordable_rounds"] == 0
    assert again["epsilon_spent"] == client.get(f"/v1/silos/{silo.id}", headers=silo.headers).json()["epsilon_spent"]


def test_calibrate_is_the_silos_calibration(client: TestClient, make_silo: Any) -> None:
    silo = make_silo(epsilon=3.0)
    body = quote(client, silo.headers, silo_id=silo.id, rounds=20, runs=[{"mechanism": STEP, "count": 1000}],
                 calibrate=True).json()
    calibrated = client.post(f"/v1/silos/{silo.id}/calibrate", headers=silo.headers,
                             json={"batch_size": 10, "steps_per_round": 3, "rounds": 20}).json()
    assert body.get("noise_multiplier") == calibrated.get("noise_multiplier") and body["noise_note"] is None, (body, calibrated)
    mixed = quote(client, silo.headers, silo_id=silo.id, rounds=2, calibrate=True,
                  runs=[{"mechanism": STEP, "count": 1}, {"mechanism": SELECT, "count": 1}]).json()
    assert mixed["noise_multiplier"] is None and "same plain DP-SGD" in mixed["noise_note"]


@pytest.mark.parametrize(("change", "field"), [
    ({"rounds": "20"}, "rounds"),
    ({"rounds": 5}, "body"),  # more job rounds than the runs hold
    ({"runs": []}, "runs"),
    ({"runs": [{"mechanism": STEP, "count": 10_001}]}, "runs.0.count"),
    ({"runs": [{"mechanism": STEP, "count": 6000}] * 2}, "body"),
    ({"runs": [{"mechanism": {**STEP, "noise_multiplier": 1 + i / 100}, "count": 1} for i in range(33)]}, "body"),
    ({"runs": [{"mechanism": {**STEP, "batch_size": 5000}, "count": 4}]}, "runs.0.mechanism"),
])
def test_bad_input_is_a_422_naming_the_field_and_writes_nothing(
    client: TestClient, make_silo: Any, change: dict[str, Any], field: str
) -> None:
    silo = make_silo()
    body = {"silo_id": silo.id, "rounds": 4, "runs": [{"mechanism": STEP, "count": 4}]} | change
    answer = client.post("/v1/quote/rounds", json=body, headers=silo.headers)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    located = {".".join(str(p) for p in d["loc"]) for d in detail} if isinstance(detail, list) else {answer.json()["field"]}
    assert any(loc.removeprefix("body.").startswith(field) for loc in located), detail
    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    assert [e["event"] for e in history] == ["create"]


def test_another_silos_key_may_not_quote_and_an_admin_may_calibrate(
    client: TestClient, make_silo: Any
) -> None:
    mine, other = make_silo(), make_silo()
    body = {"silo_id": mine.id, "rounds": 1, "runs": [{"mechanism": STEP, "count": 1}]}
    assert client.post("/v1/quote/rounds", json=body, headers=other.headers).status_code == 404  # as for any read
    assert client.post("/v1/quote/rounds", json=body | {"calibrate": True}, headers=ADMIN).status_code == 200
