"""The hash chain finds an edit of any stored field, a removed entry, and an edited budget."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import ADMIN
from tests.service.rows import charge_curve, repoint_curve

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}


def verify(client):  # type: ignore[no-untyped-def]
    response = client.get("/v1/audit/verify", headers=ADMIN)
    assert response.status_code == 200
    return response.json()


@pytest.fixture
def ledger(client, make_silo):  # type: ignore[no-untyped-def]
    silos = [make_silo(epsilon=100.0, horizon=STEP), make_silo(epsilon=100.0, horizon=STEP)]
    ids = []
    for silo in silos:
        for i in range(3):
            body = {"mechanism": STEP, "idempotency_key": f"k{i}", "job_id": "job-1", "round": i}
            ids.append(client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers).json()["charge_id"])
        client.post(f"/v1/charges/{ids[-3]}/commit", headers=silo.headers)
        client.post(f"/v1/charges/{ids[-2]}/release", headers=silo.headers)
    return silos, ids


def test_an_untouched_ledger_verifies(client, ledger) -> None:
    report = verify(client)
    assert report == {"ok": True, "entries": 2 * (1 + 3 + 2), "first_bad_seq": None, "first_bad_silo_id": None,
                      "bad_charge_ids": [], "problems": []}


def _scale_first_order(rdp: str) -> str:
    values = json.loads(rdp)
    values[0] *= 0.5
    return json.dumps(values)


# (column of the charge, how the forger changes it)
EDITS = [
    ("mechanism", lambda v: v.replace('"noise_multiplier":1.0', '"noise_multiplier":9.0')),
    ("rdp", _scale_first_order),
    ("job_id", lambda v: "other-job"),
    ("round", lambda v: 99),
    ("epsilon_spent_after", lambda v: 0.001),
    ("idempotency_key", lambda v: "forged"),
    ("status", lambda v: "released"),
]


@pytest.mark.parametrize(("column", "forge"), EDITS, ids=[c for c, _ in EDITS])
def test_an_edited_charge_is_named(client, ledger, database_url, column, forge) -> None:
    _, ids = ledger
    target = ids[5]  # the second silo's last charge, still reserved
    engine = create_engine(database_url)
    with engine.begin() as connection:
        if column == "rdp":  # the charges share their curve's row: the forger points this one at a row of its own
            forged = forge(charge_curve(connection, target))
            repoint_curve(connection, target, forged)
        else:
            value = connection.execute(text(f"SELECT {column} FROM charges WHERE id = :id"), {"id": target}).scalar_one()
            forged = forge(value)
            assert forged != value
            connection.execute(text(f"UPDATE charges SET {column} = :v WHERE id = :id"), {"v": forged, "id": target})
    engine.dispose()

    report = verify(client)

    assert report["ok"] is False
    assert target in report["bad_charge_ids"]
    assert ids[0] not in report["bad_charge_ids"]  # the first silo's chain is untouched


def test_an_edited_curve_row_names_every_charge_that_shares_it(client, ledger, database_url) -> None:
    """A curve is stored once (store/curves.py): its row edited in place changes what every charge of the
    pair reads, so each one's entries break, and the row is named as not hashing to its key."""
    _, ids = ledger
    engine = create_engine(database_url)
    with engine.begin() as connection:
        key = connection.execute(text("SELECT curve_hash FROM charges WHERE id = :id"), {"id": ids[0]}).scalar_one()
        assert connection.execute(text("SELECT count(DISTINCT curve_hash) FROM charges")).scalar_one() == 1
        assert connection.execute(text("SELECT count(*) FROM curves")).scalar_one() == 1  # one pair, one row
        original = charge_curve(connection, ids[0])
        connection.execute(text("UPDATE curves SET rdp = :t WHERE hash = :h"), {"t": _scale_first_order(original), "h": key})
    report = verify(client)
    assert report["ok"] is False
    assert sorted(report["bad_charge_ids"]) == sorted(ids)
    assert sum("does not hash to its key" in problem for problem in report["problems"]) == len(ids)
    with engine.begin() as connection:
        connection.execute(text("UPDATE curves SET rdp = :t WHERE hash = :h"), {"t": original, "h": key})
    engine.dispose()
    assert verify(client)["ok"] is True


def test_an_edited_entry_is_named(client, ledger, database_url) -> None:
    _, ids = ledger
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE ledger_entries SET epsilon_spent = 0 WHERE charge_id = :id"), {"id": ids[1]})
    engine.dispose()

    report = verify(client)

    assert report["ok"] is False and report["bad_charge_ids"] == [ids[1]]


def test_a_removed_entry_breaks_the_chain(client, ledger, database_url) -> None:
    silos, _ = ledger
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM ledger_entries WHERE silo_id = :s AND seq = 3"), {"s": silos[0].id})
    engine.dispose()

    report = verify(client)

    assert report["ok"] is False
    assert report["first_bad_silo_id"] == silos[0].id and report["first_bad_seq"] == 4


def test_an_edited_budget_breaks_the_genesis_entry(client, ledger, database_url) -> None:
    silos, _ = ledger
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE silos SET epsilon = 1000 WHERE id = :s"), {"s": silos[1].id})
    engine.dispose()

    report = verify(client)

    assert report["ok"] is False
    assert report["first_bad_silo_id"] == silos[1].id and report["first_bad_seq"] == 1


def test_a_running_sum_that_drifts_from_its_charges_is_found(client, ledger, database_url) -> None:
    silos, _ = ledger
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE silos SET rdp_spent = rdp_committed WHERE id = :s"), {"s": silos[0].id})
    engine.dispose()

    report = verify(client)

    assert report["ok"] is False
    assert any("running spent RDP sum" in p for p in report["problems"])
