"""Bad input → 422 naming the field and the reason, and nothing written."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ADMIN

GOOD = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}


def nested(depth: int) -> dict:
    mechanism: dict = {"type": "gaussian", "noise_multiplier": 1.0}
    for _ in range(depth - 1):
        mechanism = {"type": "self_composed", "count": 2, "event": mechanism}
    return mechanism


# (raw JSON of the mechanism, the loc the error must name, a word of the reason)
BAD_MECHANISMS = [
    ('{"type": "gaussian", "noise_multiplier": NaN}', ["gaussian", "noise_multiplier"], "finite"),
    ('{"type": "gaussian", "noise_multiplier": Infinity}', ["gaussian", "noise_multiplier"], "finite"),
    ('{"type": "gaussian", "noise_multiplier": -Infinity}', ["gaussian", "noise_multiplier"], "finite"),
    ('{"type": "gaussian", "noise_multiplier": -1.0}', ["gaussian", "noise_multiplier"], "greater than 0"),
    ('{"type": "gaussian", "noise_multiplier": 0}', ["gaussian", "noise_multiplier"], "greater than 0"),
    ('{"type": "laplace", "noise_multiplier": 0}', ["laplace", "noise_multiplier"], "greater than 0"),
    (
        '{"type": "dpsgd", "sampling_rate": 1.5, "noise_multiplier": 1, "steps": 1}',
        ["dpsgd", "sampling_rate"],
        "less than or equal to 1",
    ),
    (
        '{"type": "poisson_sampled", "sampling_rate": 1.01, "event": {"type": "gaussian", "noise_multiplier": 1}}',
        ["poisson_sampled", "sampling_rate"],
        "less than or equal to 1",
    ),
    ('{"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1, "steps": 0}', ["dpsgd", "steps"], "greater than or equal to 1"),
    (
        '{"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1, "steps": 1000000000000}',
        ["dpsgd", "steps"],
        "less than or equal to",
    ),
    ('{"type": "dpsgd", "batch_size": 10, "noise_multiplier": NaN, "steps": 3}', ["dpsgd", "noise_multiplier"], "finite"),
    (json.dumps(nested(9)), [], "nesting must be at most 8"),
    ('{"type": "exponential", "epsilon": 1}', [], "does not match any of the expected tags"),
    ('{"type": "gaussian"}', ["gaussian", "noise_multiplier"], "Field required"),
    ('{"type": "gaussian", "noise_multiplier": "loud"}', ["gaussian", "noise_multiplier"], "valid number"),
    ('{"type": "dpsgd", "batch_size": "ten", "noise_multiplier": 1, "steps": 1}', ["dpsgd", "batch_size"], "valid integer"),
    ('{"type": "dpsgd", "noise_multiplier": 1, "steps": 1}', ["dpsgd"], "sampling_rate or batch_size"),
    ('{"type": "zcdp", "rho": 0.1, "mu": 2}', ["zcdp", "mu"], "Extra inputs"),
    (
        '{"type": "repeat_and_select", "mean": 10, "shape": -1, "event": {"type": "gaussian", "noise_multiplier": 1}}',
        ["repeat_and_select", "shape"],
        "greater than or equal to 0",
    ),
    ('"gaussian"', [], "dict"),
]


@pytest.mark.parametrize(("raw", "loc", "reason"), BAD_MECHANISMS)
def test_a_bad_mechanism_is_a_422_naming_the_field_and_writes_nothing(client, make_silo, raw, loc, reason) -> None:
    silo = make_silo()
    before = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()

    body = '{"idempotency_key": "k", "mechanism": ' + raw + "}"
    response = client.post(
        f"/v1/silos/{silo.id}/charges", content=body, headers={**silo.headers, "Content-Type": "application/json"}
    )

    assert response.status_code == 422, response.text
    error = response.json()["detail"][0]
    assert error["loc"][:2] == ["body", "mechanism"]
    assert error["loc"][2:2 + len(loc)] == loc
    assert reason in error["msg"]
    assert client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json() == before
    assert client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()["epsilon_spent"] == 0.0


def test_depth_eight_is_accepted(client, make_silo) -> None:
    silo = make_silo(epsilon=1000.0)
    response = client.post(
        f"/v1/silos/{silo.id}/charges", json={"idempotency_key": "k", "mechanism": nested(8)}, headers=silo.headers
    )
    assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"name": "a", "epsilon": 1, "delta": 1.0, "dataset_size": 10}, "delta", "less than 1"),
        ({"name": "a", "epsilon": 1, "delta": 2.0, "dataset_size": 10}, "delta", "less than 1"),
        ({"name": "a", "epsilon": 0, "delta": 1e-5, "dataset_size": 10}, "epsilon", "greater than 0"),
        ({"name": "a", "epsilon": -3, "delta": 1e-5, "dataset_size": 10}, "epsilon", "greater than 0"),
        ({"name": "a", "epsilon": 1, "delta": 1e-5, "dataset_size": 0}, "dataset_size", "greater than or equal to 1"),
        ({"name": "", "epsilon": 1, "delta": 1e-5, "dataset_size": 10}, "name", "at least 1 character"),
        ({"epsilon": 1, "delta": 1e-5, "dataset_size": 10}, "name", "Field required"),
        ({"name": "a", "epsilon": "much", "delta": 1e-5, "dataset_size": 10}, "epsilon", "valid number"),
    ],
)
def test_bad_silo_registration_is_a_422_and_creates_nothing(client, body, field, reason) -> None:
    response = client.post("/v1/silos", json=body, headers=ADMIN)
    assert response.status_code == 422
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", field] and reason in error["msg"]
    assert client.get("/v1/silos", headers=ADMIN).json() == []


def test_non_finite_budget_is_refused(client) -> None:
    body = '{"name": "a", "epsilon": Infinity, "delta": 1e-5, "dataset_size": 10}'
    response = client.post("/v1/silos", content=body, headers={**ADMIN, "Content-Type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "epsilon"]


def test_a_taken_name_is_a_conflict(client, make_silo) -> None:
    make_silo(name="clinic")
    response = client.post("/v1/silos", json={"name": "clinic", "epsilon": 1, "delta": 1e-5, "dataset_size": 5}, headers=ADMIN)
    assert response.status_code == 409 and "clinic" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"epsilon": 1, "delta": 1e-5, "sampling_rate": 0, "steps": 10}, "sampling_rate"),
        ({"epsilon": 1, "delta": 1, "sampling_rate": 0.1, "steps": 10}, "delta"),
        ({"epsilon": 0, "delta": 1e-5, "sampling_rate": 0.1, "steps": 10}, "epsilon"),
        ({"epsilon": 5e-324, "delta": 1e-5, "sampling_rate": 0.1, "steps": 10}, "epsilon"),  # below the 1e-4 floor
        ({"epsilon": 1, "delta": 1e-5, "sampling_rate": 0.1, "steps": 0}, "steps"),
    ],
)
def test_bad_calibration_requests(client, body, field) -> None:
    response = client.post("/v1/calibrate", json=body, headers=ADMIN)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", field]


@pytest.mark.parametrize(
    "mechanism",
    [
        {"type": "poisson_sampled", "expected_batch_size": 100, "event": {"type": "laplace", "noise_multiplier": 1.0}},
        {"type": "laplace", "noise_multiplier": 5e-324},
        {"type": "repeat_and_select", "mean": 3, "shape": 1, "event": {
            "type": "composed", "events": [
                {"type": "sampled_without_replacement", "source_size": 1000, "sample_size": 10,
                 "event": {"type": "gaussian", "noise_multiplier": 2.0}},
                {"type": "poisson_sampled", "expected_batch_size": 100, "event": {"type": "gaussian", "noise_multiplier": 2.0}},
            ]}},
    ],
    ids=["poisson-over-laplace", "laplace-overflow", "mixed-relations-in-one-selection"],
)
def test_a_mechanism_dp_accounting_cannot_account_is_a_422_not_a_crash(client, make_silo, mechanism) -> None:
    silo = make_silo(epsilon=1000.0)
    before = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    for path, body in ((f"/v1/silos/{silo.id}/charges", {"mechanism": mechanism, "idempotency_key": "k"}),
                       ("/v1/quote", {"mechanism": mechanism, "silo_id": silo.id})):
        response = client.post(path, json=body, headers=silo.headers)
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body", "mechanism"]
        assert "dp-accounting" in response.json()["detail"][0]["msg"]
    assert client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json() == before
