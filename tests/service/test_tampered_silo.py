"""A silo row edited in the database (its filter, its budget) is named in a JSON 409, never a 500, and
nothing is approved on it until an admin restores the row or seals the record as it stands; the seal
is an entry of the silo's chain and of the transparency log, and does not hide the edit from the log."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from dpledger.audit.transparency import audit
from tests.conftest import ADMIN, bearer
from tests.service.rows import entries, logged, sql

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}


def silo(client: TestClient, name: str) -> tuple[int, dict[str, str]]:
    created = client.post("/v1/silos", headers=ADMIN, json={"name": name, "epsilon": 3.0, "delta": 1e-5, "dataset_size": 1000})
    assert created.status_code == 201, created.text
    return created.json()["id"], bearer(created.json()["api_key"])


def charge(client: TestClient, silo_id: int, headers: dict[str, str], key: str) -> Any:
    return client.post(f"/v1/silos/{silo_id}/charges", headers=headers, json={"mechanism": STEP, "idempotency_key": key})


def events(client: TestClient, silo_id: int) -> list[str]:
    return [e["event"] for e in client.get(f"/v1/silos/{silo_id}/history", headers=ADMIN).json()]


def covering(client: TestClient, silo_id: int, column: str) -> tuple[int, str]:
    """(seq, event) of the entry whose hash covers `column` of the silo row: the create entry, or for
    the filter, the filter entry of a silo whose first charge fixed it."""
    history = events(client, silo_id)
    if column == "filter_spec" and "filter" in history:
        return history.index("filter") + 1, "filter"
    return 1, "create"


def assert_names(response: Any, silo_id: int, seq: int, event: str) -> None:
    assert response.status_code == 409, response.text
    body = response.json()  # JSON, whatever the edit
    assert body["tampered"] == {"silo_id": silo_id, "table": "silos", "entry_seq": seq, "entry_event": event}
    assert body["detail"].startswith(f"silo {silo_id}'s record (the silos row) no longer matches the hash of the entry "
                                     f"that covers it: its {event} entry (seq {seq}) covers it")
    assert f"POST /v1/silos/{silo_id}/seal" in body["detail"]


@pytest.mark.parametrize("edit", [
    # A filter that still parses, with every δ share on one order: the gate would read a smaller ε.
    "UPDATE silos SET filter_spec = :spec WHERE id = :id",
    # A filter that no longer parses at all: the request used to answer a 500 with a non-JSON body.
    "UPDATE silos SET filter_spec = '{\"orders\": [' WHERE id = :id",
    "UPDATE silos SET epsilon = epsilon * 2 WHERE id = :id",
])
def test_an_edited_silo_row_is_named_and_refused_until_restored(client: TestClient, engine: Engine, edit: str) -> None:
    tampered, headers = silo(client, "tampered")
    other, other_headers = silo(client, "other")
    assert charge(client, tampered, headers, "before").status_code == 201
    original = sql(engine, "SELECT filter_spec, epsilon FROM silos WHERE id = :id", id=tampered).one()
    spec = json.loads(original.filter_spec)
    one_order = json.dumps({"orders": spec["orders"][:1], "weights": [1.0], "source": spec["source"]})
    seq, event = covering(client, tampered, "filter_spec" if "filter_spec" in edit else "epsilon")
    history = events(client, tampered)
    sql(engine, edit, id=tampered, **({"spec": one_order} if ":spec" in edit else {}))
    written = entries(engine)

    for response in (client.get(f"/v1/silos/{tampered}", headers=headers), client.get(f"/v1/silos/{tampered}", headers=ADMIN),
                     client.get("/v1/silos", headers=ADMIN), charge(client, tampered, headers, "after"),
                     client.post(f"/v1/silos/{tampered}/calibrate", headers=headers,
                                 json={"batch_size": 10, "rounds": 1, "steps_per_round": 1})):
        assert_names(response, tampered, seq, event)
    assert entries(engine) == written  # the refusals wrote nothing
    # The history stays readable (it is what the admin inspects), and the other silo is untouched.
    assert events(client, tampered) == history and history[-1] == "reserve"
    assert charge(client, other, other_headers, "other").status_code == 201
    # Restoring the row resolves it: the hashes recompute, and approvals resume.
    sql(engine, "UPDATE silos SET filter_spec = :f, epsilon = :e WHERE id = :id",
        f=original.filter_spec, e=original.epsilon, id=tampered)
    assert client.get(f"/v1/silos/{tampered}", headers=headers).status_code == 200
    assert charge(client, tampered, headers, "after").status_code == 201
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


def test_an_admin_seals_the_record_as_it_stands_in_an_entry_of_the_chain_and_the_log(client: TestClient, engine: Engine) -> None:
    tampered, headers = silo(client, "tampered")
    assert charge(client, tampered, headers, "before").status_code == 201
    auditor = bearer(client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"])
    seal = f"/v1/silos/{tampered}/seal"
    refused = client.post(seal, headers=ADMIN)
    assert refused.status_code == 409
    assert refused.json()["detail"] == f"silo {tampered}'s record matches the hashes of its entries: there is nothing to seal"
    original = sql(engine, "SELECT filter_spec FROM silos WHERE id = :id", id=tampered).scalar_one()
    sql(engine, "UPDATE silos SET filter_spec = 'garbage' WHERE id = :id", id=tampered)
    unreadable = client.post(seal, headers=ADMIN)
    assert unreadable.status_code == 409
    assert unreadable.json()["detail"].startswith(f"silo {tampered}'s record cannot be sealed as it stands: its filter "
                                                  "does not parse")
    sql(engine, "UPDATE silos SET filter_spec = :f, epsilon = 6.0 WHERE id = :id", f=original, id=tampered)
    assert client.post(seal, headers=headers).status_code == 403  # the silo's own key may not accept its record
    assert client.post(seal, headers=auditor).status_code == 403
    written, before = entries(engine), events(client, tampered)
    sealed = client.post(seal, headers=ADMIN)
    assert sealed.status_code == 200, sealed.text
    assert sealed.json()["epsilon"] == 6.0
    assert entries(engine) == written + 1
    history = client.get(f"/v1/silos/{tampered}/history", headers=ADMIN).json()
    assert [e["event"] for e in history] == [*before, "seal"]
    assert history[-1]["subject"]["epsilon"] == 6.0
    # Approvals resume, the chain check accepts the sealed record, and a second seal has nothing to do.
    assert charge(client, tampered, headers, "after").status_code == 201
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
    assert client.post(seal, headers=ADMIN).status_code == 409
    # An edit after the seal is caught against the seal's entry.
    sql(engine, "UPDATE silos SET delta = 1e-3 WHERE id = :id", id=tampered)
    late = charge(client, tampered, headers, "late")
    assert late.status_code == 409 and late.json()["tampered"]["entry_event"] == "seal"
    assert late.json()["tampered"]["entry_seq"] == len(history)
    sql(engine, "UPDATE silos SET delta = 1e-5 WHERE id = :id", id=tampered)

    # The log does not forget: its leaf for the create entry no longer matches the record it was signed over.
    def get(path: str, params: dict[str, Any] | None) -> Any:
        response = client.get(path, params=params, headers=auditor)
        assert response.status_code == 200, response.text
        return response.json()

    logged(client, engine)  # the head the audit reads holds every entry, the create entry's leaf included
    found = audit(get, None)
    assert found.problems == ["log index 0: the entry no longer matches its leaf (edited after it was logged)"]


def test_a_silo_whose_first_charge_is_to_fix_its_filter_is_restored_not_sealed(client: TestClient, engine: Engine) -> None:
    """A seal covers the record as it stands, filter included; a pending silo's first charge would then
    fix another filter under it, so the seal is refused (nothing is spent: restoring the row is the
    remedy), and a plan, which a seal's hash does not cover, may not be declared after one."""
    pending, headers = silo(client, "pending")
    sql(engine, "UPDATE silos SET epsilon = 6.0 WHERE id = :id", id=pending)
    refused = client.post(f"/v1/silos/{pending}/seal", headers=ADMIN)
    assert refused.status_code == 409
    assert refused.json()["detail"] == (f"silo {pending}'s record cannot be sealed as it stands: its filter is still to be "
                                        "fixed by its first charge, which a seal would forbid. Restore the row first")
    sql(engine, "UPDATE silos SET epsilon = 3.0 WHERE id = :id", id=pending)
    assert charge(client, pending, headers, "first").status_code == 201  # fixes the filter, as for any silo

    # Registered with a horizon, its filter is fixed at once: it may be sealed before any charge.
    created = client.post("/v1/silos", headers=ADMIN, json={"name": "sealed", "epsilon": 3.0, "delta": 1e-5,
                                                             "dataset_size": 1000, "horizon": STEP})
    sealed, sealed_headers = created.json()["id"], bearer(created.json()["api_key"])
    sql(engine, "UPDATE silos SET epsilon = 6.0 WHERE id = :id", id=sealed)
    assert client.post(f"/v1/silos/{sealed}/seal", headers=ADMIN).status_code == 200
    plan = client.post(f"/v1/silos/{sealed}/plan", headers=ADMIN, json={"mechanism": {**STEP, "steps": 100}})
    assert plan.status_code == 409
    assert plan.json()["detail"] == (f"silo {sealed}'s record is sealed as it stood, with no plan; a plan is declared "
                                     "before a seal")
    assert charge(client, sealed, sealed_headers, "second").status_code == 201
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


@pytest.mark.parametrize("database_url", [pytest.param("postgres")], indirect=True)
def test_an_edit_that_python_reads_as_equal_is_still_named_after_the_record_was_found_sound(
    client: TestClient, engine: Engine,
) -> None:
    # The record check keeps what it found sound (seals._SOUND), by the values the hash reads. -0.0
    # equals 0.0 in Python but is written "-0.0" in the JSON the create entry's hash covers: the
    # edit must be named at the next approval, as without anything kept. (SQLite stores -0.0 as 0.0.)
    tampered, headers = silo(client, "signed-zero")
    assert charge(client, tampered, headers, "before").status_code == 201  # found sound, and kept
    assert charge(client, tampered, headers, "again").status_code == 201
    sql(engine, "UPDATE ledger_entries SET epsilon_spent = '-0'::float8 WHERE silo_id = :id AND seq = 1", id=tampered)
    assert sql(engine, "SELECT epsilon_spent::text FROM ledger_entries WHERE silo_id = :id AND seq = 1",
               id=tampered).scalar_one() == "-0"
    assert_names(charge(client, tampered, headers, "after"), tampered, 1, "create")


BAD_CURVE = "0" * 64  # a curves row's key that its text does not hash to
HOSTILE = [
    # A filter whose weights put every δ share on one order (issue 41): the audit names it, never crashes.
    "UPDATE silos SET filter_spec = :one_weight WHERE id = :id",
    "UPDATE silos SET plan = '{\"segments\": [' WHERE id = :id",
    "UPDATE silos SET rdp_spent = 'not a sum', rdp_committed = '{\"finite\": [1.0], \"infinite\": [0]}' WHERE id = :id",
    # Its charges' curve a row that neither parses nor hashes to its key (inserted first, below), and their mechanism.
    "UPDATE charges SET curve_hash = :bad_curve, mechanism = '{' WHERE silo_id = :id",
    "UPDATE charges SET status = 'refunded' WHERE silo_id = :id",
    "UPDATE ledger_entries SET event = 'gift' WHERE silo_id = :id AND seq = 2",
]


def test_the_chain_check_reports_a_hostile_record_as_a_finding_never_a_crash(client: TestClient, engine: Engine) -> None:
    other, other_headers = silo(client, "other")
    assert charge(client, other, other_headers, "a").status_code == 201
    for i, edit in enumerate(HOSTILE):  # each on a silo of its own; the ones before stay edited
        tampered, headers = silo(client, f"hostile-{i}")
        declared = client.post(f"/v1/silos/{tampered}/plan", headers=ADMIN, json={"mechanism": {**STEP, "steps": 3}})
        assert declared.status_code == 201, declared.text
        for key in ("a", "b"):
            assert charge(client, tampered, headers, key).status_code == 201
        spec = json.loads(sql(engine, "SELECT filter_spec FROM silos WHERE id = :id", id=tampered).scalar_one())
        one_weight = json.dumps({**spec, "weights": [1.0] + [0.0] * (len(spec["weights"]) - 1)})
        if ":bad_curve" in edit:
            sql(engine, "INSERT INTO curves (hash, rdp) VALUES (:h, '[1, 2')", h=BAD_CURVE)
        sql(engine, edit, id=tampered, **({"one_weight": one_weight} if ":one_weight" in edit else {}),
            **({"bad_curve": BAD_CURVE} if ":bad_curve" in edit else {}))
        report = client.get("/v1/audit/verify", headers=ADMIN)
        assert report.status_code == 200, (edit, report.text)
        assert report.json()["ok"] is False
        problems = report.json()["problems"]
        assert any(p.startswith(f"silo {tampered}: ") for p in problems), (edit, problems)
        assert not any(p.startswith(f"silo {other}: ") for p in problems), (edit, problems)  # the others are audited
        if "UPDATE silos" in edit:
            assert charge(client, tampered, headers, "after").status_code == 409  # and the gate refuses the record
