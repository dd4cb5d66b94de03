"""Every column of the silos table that the gate or an approval reads is sealed by construction: covered
as stored by the hash of an entry of the silo's chain (seals.HASHED), or recomputed from the chain at
each load (seals.RECOMPUTED, ledger/replayed.py). The table is enumerated from the migrated schema, and
an edit of each column in the database is refused (a 409 naming the record) before any approval."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, inspect

from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger import chain, seals
from dpledger.service.store.db import migrate
from dpledger.service.store.models import Silo
from dpledger.wire.enums import Relation
from tests.conftest import ADMIN, bearer
from tests.service.rows import charge_curve, entries, repoint_curve, sql

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
OFF_PLAN = {**STEP, "noise_multiplier": 2.0}


def test_every_column_of_the_silos_table_is_hashed_or_recomputed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/schema.db"
    migrate(url)
    engine = create_engine(url)
    migrated = {column["name"] for column in inspect(engine).get_columns("silos")}
    engine.dispose()
    modelled = set(Silo.__table__.columns.keys())
    declared = [*seals.HASHED, *seals.RECOMPUTED, *seals.UNREAD]
    assert len(declared) == len(set(declared)), "a column is declared twice"
    assert migrated == modelled == set(declared), (
        f"neither hashed nor recomputed: {sorted(migrated - set(declared))}; declared but absent: "
        f"{sorted(set(declared) - migrated)}")
    assert all(reason for reason in [*seals.RECOMPUTED.values(), *seals.UNREAD.values()])


def _silo(**changed: Any) -> Silo:
    fields: dict[str, Any] = {
        "id": 7, "name": "ward", "epsilon": 3.0, "delta": 1e-5, "dataset_size": 1000, "relation": Relation.add_remove,
        "created_at": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC), "filter_spec": '{"orders": [2.0]}', "filter_seq": 1,
        "plan": '{"segments": []}', "retired_reason": "mis-registered", "sealed_seq": None, "retired_seq": None,
    }
    return Silo(**{**fields, **changed})


EDITED: dict[str, Any] = {
    "id": 8, "name": "ward-2", "epsilon": 6.0, "delta": 1e-3, "dataset_size": 999, "relation": Relation.replace_one,
    "created_at": datetime(2026, 1, 2, 3, 4, 5, 7, tzinfo=UTC), "filter_spec": '{"orders": [3.0]}',
    "plan": '{"segments": [1]}', "retired_reason": "a kinder reason", "registered_filter": '{"orders": [4.0]}',
}


@pytest.mark.parametrize("column", sorted(seals.HASHED))
def test_each_hashed_column_is_in_what_its_entries_hash_covers(column: str) -> None:
    assert set(EDITED) == set(seals.HASHED)
    for event in seals.HASHED[column]:
        before, after = _silo(), _silo(**{column: EDITED[column]})
        assert chain.subject(event, before, None) != chain.subject(event, after, None), (column, event)


# Each edit an operator with the database could make of one column, as SQL on the silo `:id`.
EDITS: dict[str, str] = {
    "name": "UPDATE silos SET name = name || '-x' WHERE id = :id",
    "epsilon": "UPDATE silos SET epsilon = epsilon * 2 WHERE id = :id",
    "delta": "UPDATE silos SET delta = delta * 10 WHERE id = :id",
    "dataset_size": "UPDATE silos SET dataset_size = dataset_size * 2 WHERE id = :id",
    "relation": "UPDATE silos SET relation = 'replace_one' WHERE id = :id",
    "created_at": "UPDATE silos SET created_at = :earlier WHERE id = :id",
    "filter_spec": "UPDATE silos SET filter_spec = :one_order WHERE id = :id",
    # A registered filter put beside one never refit: the first charge could no longer refit it.
    "registered_filter": "UPDATE silos SET registered_filter = filter_spec WHERE id = :id",
    "plan": "UPDATE silos SET plan = plan || ' ' WHERE id = :id",  # the same plan as JSON, not as the hashed text
    "rdp_spent": "UPDATE silos SET rdp_spent = :empty WHERE id = :id",  # a lowered running sum
    "rdp_committed": "UPDATE silos SET rdp_committed = :empty WHERE id = :id",
    "chain_seq": "UPDATE silos SET chain_seq = chain_seq - 1 WHERE id = :id",
    "chain_head": "UPDATE silos SET chain_head = :zeros WHERE id = :id",
    "filter_seq": "UPDATE silos SET filter_seq = 0 WHERE id = :id",
    # The attack: the plan's branch revived, so the gate reads the plan's smaller ε again.
    "plan_used": "UPDATE silos SET plan_used = 0, plan_ended_seq = NULL WHERE id = :id",
    "plan_ended_seq": "UPDATE silos SET plan_ended_seq = NULL WHERE id = :id",
    "sealed_seq": "UPDATE silos SET sealed_seq = 2 WHERE id = :id",
    # On the retired silo: its charges would be approved again.
    "retired_seq": "UPDATE silos SET retired_seq = NULL WHERE id = :id",
    "retired_reason": "UPDATE silos SET retired_reason = 'a kinder reason' WHERE id = :id",
}
# The primary key is covered by the create entry's hash (above), but an edit of it alone is refused by the
# database itself: every other table names the silo by it (foreign keys).
NOT_EDITABLE_ALONE = {"id"}
ROW = ("name", "epsilon", "delta", "dataset_size", "relation", "created_at", "filter_spec", "plan", "rdp_spent",
       "rdp_committed", "chain_seq", "chain_head", "filter_seq", "plan_used", "plan_ended_seq", "sealed_seq",
       "retired_seq", "retired_reason", "registered_filter")


def _charge(client: TestClient, silo_id: int, headers: dict[str, str], key: str, mechanism: dict[str, Any] = STEP) -> Any:
    return client.post(f"/v1/silos/{silo_id}/charges", headers=headers, json={"mechanism": mechanism, "idempotency_key": key})


def _register(client: TestClient, name: str) -> tuple[int, dict[str, str]]:
    created = client.post("/v1/silos", headers=ADMIN, json={"name": name, "epsilon": 10.0, "delta": 1e-5,
                                                            "dataset_size": 1000, "horizon": STEP})
    assert created.status_code == 201, created.text
    return created.json()["id"], bearer(created.json()["api_key"])


def test_an_edit_of_any_column_is_refused_before_any_approval(client: TestClient, engine: Engine) -> None:
    assert set(EDITS) | NOT_EDITABLE_ALONE == set(seals.HASHED) | set(seals.RECOMPUTED) | set(seals.UNREAD)
    # A silo on a plan whose branch a charge off the plan ended, with committed and released charges.
    planned, headers = _register(client, "planned")
    declared = client.post(f"/v1/silos/{planned}/plan", headers=ADMIN, json={"mechanism": {**STEP, "steps": 4}})
    assert declared.status_code == 201, declared.text
    reserved = [_charge(client, planned, headers, f"c{i}").json()["charge_id"] for i in range(3)]
    assert client.post(f"/v1/charges/{reserved[0]}/commit", headers=headers).status_code == 200
    assert client.post(f"/v1/charges/{reserved[1]}/release", headers=headers).status_code == 200
    assert _charge(client, planned, headers, "off", OFF_PLAN).status_code == 201
    row = sql(engine, "SELECT plan_used, plan_ended_seq FROM silos WHERE id = :id", id=planned).one()
    assert row.plan_used == 3 and row.plan_ended_seq == 8  # create, plan, 3 reserves, commit, release: the 8th ends it
    retired, retired_headers = _register(client, "retired")
    assert _charge(client, retired, retired_headers, "r0").status_code == 201
    assert client.post(f"/v1/silos/{retired}/retire", headers=ADMIN, json={"reason": "mis-registered"}).status_code == 200

    spec = json.loads(sql(engine, "SELECT filter_spec FROM silos WHERE id = :id", id=planned).scalar_one())
    params = {"earlier": datetime.now(UTC) - timedelta(days=1), "zeros": "0" * 64,
              "empty": RunningSum.empty(len(rdp.ORDERS)).to_json(),
              "one_order": json.dumps({**spec, "orders": spec["orders"][:1], "weights": [1.0]})}
    for column, edit in EDITS.items():
        target, target_headers = (retired, retired_headers) if column.startswith("retired") else (planned, headers)
        original = sql(engine, f"SELECT {', '.join(ROW)} FROM silos WHERE id = :id", id=target).one()._asdict()
        written = entries(engine)
        sql(engine, edit, id=target, **{k: v for k, v in params.items() if f":{k}" in edit})
        refused = _charge(client, target, target_headers, f"after-{column}")
        assert refused.status_code == 409, (column, refused.text)
        body = refused.json()
        assert body["tampered"]["silo_id"] == target and body["tampered"]["table"] == "silos", (column, body)
        assert body["detail"].startswith(f"silo {target}'s record (the silos row) "), (column, body)
        assert entries(engine) == written, column  # nothing approved, nothing written
        sql(engine, f"UPDATE silos SET {', '.join(f'{c} = :{c}' for c in ROW)} WHERE id = :id", id=target, **original)
        assert client.get(f"/v1/silos/{target}", headers=ADMIN).status_code == 200, column
    # Restored, the planned silo approves again, under the filter alone (its branch stays ended).
    assert _charge(client, planned, headers, "restored").status_code == 201
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True



def test_a_charge_edited_before_its_release_is_refused_and_the_sum_kept(client: TestClient, engine: Engine) -> None:
    # A release subtracts the charge's curve from the running sum that the record check derives from the
    # chain: a curve edited upward would lower the sum by more than was reserved.
    target, headers = _register(client, "released")
    held = _charge(client, target, headers, "held").json()["charge_id"]
    sums = sql(engine, "SELECT rdp_spent, chain_seq FROM silos WHERE id = :id", id=target).one()
    with engine.begin() as connection:  # its curve four times larger: a row of the forger's, the charge pointed at it
        undo = repoint_curve(connection, held, json.dumps([4 * x for x in json.loads(charge_curve(connection, held))]))
    written = entries(engine)
    refused = client.post(f"/v1/charges/{held}/release", headers=headers)
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"].startswith(f"charge {held} no longer matches its reserve entry (seq 2)'s hash")
    assert entries(engine) == written
    assert sql(engine, "SELECT rdp_spent, chain_seq FROM silos WHERE id = :id", id=target).one() == sums
    with engine.begin() as connection:
        undo(connection)
    assert client.post(f"/v1/charges/{held}/release", headers=headers).status_code == 200
    assert _charge(client, target, headers, "next").status_code == 201
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
