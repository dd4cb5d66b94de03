"""`/metrics` and the structured logs, through the real app on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpledger.service.logging_setup import JsonFormatter
from tests.conftest import ADMIN, ADMIN_KEY

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}
CHARGES_ROUTE = "/v1/silos/{silo_id}/charges"


def samples(client, headers=None) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:  # type: ignore[no-untyped-def]
    response = client.get("/metrics", headers=headers or {})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(metrics, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return metrics.get((name, frozenset(labels.items())), 0.0)


def charge(client, silo, key: str):  # type: ignore[no-untyped-def]
    return client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": STEP, "idempotency_key": key}, headers=silo.headers)


def test_counters_count_exactly_the_approvals_refusals_and_errors(client, make_silo) -> None:
    silo = make_silo(epsilon=1.0)
    approved = 0
    while charge(client, silo, f"a{approved}").status_code == 201:
        approved += 1
    refused = 1  # the loop's last request
    for i in range(2):
        assert charge(client, silo, f"again{i}").status_code == 409
        refused += 1
    assert charge(client, silo, "a0").status_code == 200  # an idempotent retry of the first approval
    other = make_silo()
    assert client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": STEP, "idempotency_key": "x"},
                       headers=other.headers).status_code == 404
    assert client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": {"type": "gaussian"}, "idempotency_key": "y"},
                       headers=silo.headers).status_code == 422

    metrics = samples(client, ADMIN)

    assert approved >= 3
    assert value(metrics, "dpledger_charge_decisions_total", outcome="approved", reason="reserved") == approved
    assert value(metrics, "dpledger_charge_decisions_total", outcome="approved", reason="replayed") == 1
    assert value(metrics, "dpledger_charge_decisions_total", outcome="refused", reason="over_budget") == refused
    assert value(metrics, "dpledger_charge_decisions_total", outcome="error", reason="not_found") == 1
    assert value(metrics, "dpledger_charge_decisions_total", outcome="error", reason="invalid_request") == 1


def test_the_latency_histogram_counts_every_request_by_route_template(client, make_silo) -> None:
    silos = [make_silo(), make_silo()]
    for silo in silos:
        for i in range(3):
            assert charge(client, silo, f"k{i}").status_code == 201
        assert client.get(f"/v1/silos/{silo.id}", headers=silo.headers).status_code == 200
    assert client.get("/no/such/path").status_code == 404

    metrics = samples(client)

    count = "dpledger_http_request_duration_seconds_count"
    assert value(metrics, count, route=CHARGES_ROUTE, method="POST", status_class="2xx") == 6
    assert value(metrics, count, route="/v1/silos/{silo_id}", method="GET", status_class="2xx") == 2
    assert value(metrics, count, route="/v1/silos", method="POST", status_class="2xx") == 2
    assert value(metrics, count, route="<unmatched>", method="GET", status_class="4xx") == 1
    assert value(metrics, "dpledger_http_request_duration_seconds_bucket",
                 route=CHARGES_ROUTE, method="POST", status_class="2xx", le="+Inf") == 6
    routes = {dict(labels).get("route") for (_, labels) in metrics}
    assert not any(r and re.search(r"/\d+(/|$)", r) for r in routes)  # never a raw path with an id in it


def test_only_the_admin_sees_each_silos_epsilon(client, make_silo) -> None:
    silos = [make_silo(epsilon=3.0), make_silo(epsilon=5.0)]
    for i in range(4):
        assert charge(client, silos[0], f"k{i}").status_code == 201
    auditor_key = client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]

    admin_view = samples(client, ADMIN)

    for silo in silos:
        detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
        spent = value(admin_view, "dpledger_silo_epsilon_spent", silo_id=str(silo.id))
        assert spent == pytest.approx(detail["epsilon_spent"], rel=1e-12)
        assert value(admin_view, "dpledger_silo_epsilon_budget", silo_id=str(silo.id)) == detail["epsilon"]
    assert value(admin_view, "dpledger_silo_epsilon_spent", silo_id=str(silos[0].id)) > 0

    for headers in ({}, silos[0].headers, {"Authorization": f"Bearer {auditor_key}"}, {"Authorization": "Bearer dpl_guess"}):
        view = samples(client, headers)
        assert not any("silo_id" in dict(labels) for (_, labels) in view)
        assert not any(name.startswith("dpledger_silo_") for (name, _) in view)
        # Issue 13, item 8: how often silos are refused over budget is budget information too.
        assert not any(name.startswith("dpledger_charge_decisions") for (name, _) in view)
        assert value(view, "dpledger_http_request_duration_seconds_count",
                     route=CHARGES_ROUTE, method="POST", status_class="2xx") == 4


def test_access_and_decision_logs_are_json_with_the_fields_and_no_key(client, make_silo, caplog) -> None:
    silo = make_silo(epsilon=1.0)
    silo_key = silo.headers["Authorization"].removeprefix("Bearer ")
    caplog.set_level(logging.INFO, logger="dpledger")

    approved = charge(client, silo, "first")
    response = client.get(f"/v1/silos/{silo.id}", headers={**silo.headers, "X-Request-ID": "trace-42"})

    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(r)) for r in caplog.records]
    for record in caplog.records:
        text = formatter.format(record)
        assert ADMIN_KEY not in text and silo_key not in text and "Authorization" not in text
    access = [line for line in lines if line["logger"] == "dpledger.access"]
    assert len(access) == 2
    charge_line = access[0]
    assert charge_line["method"] == "POST" and charge_line["route"] == CHARGES_ROUTE and charge_line["status"] == 201
    assert charge_line["role"] == "silo" and isinstance(charge_line["key_id"], int)
    assert charge_line["silo_id"] == silo.id and charge_line["outcome"] == "approved"
    assert charge_line["charge_id"] == approved.json()["charge_id"]
    assert charge_line["request_id"] == approved.headers["x-request-id"]
    assert 0 < charge_line["duration_ms"] < 60_000 and charge_line["time"].endswith("+00:00")
    assert access[1]["request_id"] == "trace-42" == response.headers["x-request-id"]
    assert access[1]["route"] == "/v1/silos/{silo_id}" and "outcome" not in access[1]

    decisions = [line for line in lines if line["logger"] == "dpledger.ledger"]
    assert decisions == [{
        "time": decisions[0]["time"], "level": "info", "logger": "dpledger.ledger", "message": "charge approved",
        "event": "charge_decision", "outcome": "approved", "reason": "reserved", "silo_id": silo.id,
        "charge_id": approved.json()["charge_id"], "epsilon_spent": approved.json()["epsilon_spent"],
        "epsilon_if_approved": None,
    }]


def test_a_refusal_is_logged_with_the_epsilon_it_would_have_spent(client, make_silo, caplog) -> None:
    silo = make_silo(epsilon=0.01)
    caplog.set_level(logging.INFO, logger="dpledger.ledger")

    refused = charge(client, silo, "too-much")

    assert refused.status_code == 409
    (record,) = [r for r in caplog.records if r.name == "dpledger.ledger"]
    line = json.loads(JsonFormatter().format(record))
    assert line["outcome"] == "refused" and line["reason"] == "over_budget" and line["charge_id"] is None
    assert line["silo_id"] == silo.id
    assert line["epsilon_spent"] == refused.json()["epsilon_spent"] == 0.0
    assert line["epsilon_if_approved"] == refused.json()["epsilon_if_approved"]
