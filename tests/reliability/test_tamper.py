"""Tampering by SQL under a running server: `GET /v1/audit/verify` over HTTP names the charge and the
silo of every edit, answers (never a 500) when a stored field no longer even parses, and verifies
again once the row is put back.

tests/service/ledger/test_audit_chain.py covers single-column charge edits, an entry edit, a removed
entry and an edited budget in-process; this adds, through a real uvicorn: status edits that would
hand budget back, unparsable RDP vectors and statuses, a charge moved to another silo, an entry's
event rewritten, and removed entries whose charge's other entries survive (the charge whose entry
went missing must be the one named, not only its neighbour).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import Connection, create_engine, text

from dpledger.harness import ServerProcess
from tests.conftest import ADMIN_KEY
from tests.reliability.loadgen import ADMIN, verify_chain
from tests.service.rows import charge_curve, repoint_curve

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}


@dataclass(frozen=True)
class Ledger:
    a: int  # silo ids
    b: int
    charges: dict[str, int]  # "a0", "b0".."b4" → charge id


def build_ledger(url: str) -> Ledger:
    """Silo a: a0 reserved+committed. Silo b's chain, by seq (a silo registered without a horizon has
    its filter fixed by its first charge, in a filter entry just before that charge's reserve):
    1 create, 2 filter, 3 reserve b0, 4 commit b0, 5 reserve b1, 6 release b1, 7 reserve b2,
    8 reserve b3, 9 commit b3, 10 commit b2, 11 reserve b4 (b4 stays reserved)."""
    ids: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        silos = {}
        for name in ("a", "b"):
            r = client.post("/v1/silos", headers=ADMIN, json={"name": f"tamper-{name}", "epsilon": 100.0, "delta": 1e-5,
                                                                 "dataset_size": 1000})
            assert r.status_code == 201, r.text
            silos[name] = (r.json()["id"], {"Authorization": f"Bearer {r.json()['api_key']}"})

        def reserve(label: str) -> None:
            silo_id, headers = silos[label[0]]
            r = client.post(f"/v1/silos/{silo_id}/charges", headers=headers,
                            json={"mechanism": STEP, "idempotency_key": label, "job_id": "tamper", "round": len(ids)})
            assert r.status_code == 201, r.text
            ids[label] = r.json()["charge_id"]

        def settle(label: str, action: str) -> None:
            r = client.post(f"/v1/charges/{ids[label]}/{action}", headers=silos[label[0]][1])
            assert r.status_code == 200, r.text

        for label, action in [("a0", None), ("a0", "commit"), ("b0", None), ("b0", "commit"), ("b1", None),
                              ("b1", "release"), ("b2", None), ("b3", None), ("b3", "commit"), ("b2", "commit"), ("b4", None)]:
            if action is None:
                reserve(label)
            else:
                settle(label, action)
    return Ledger(a=silos["a"][0], b=silos["b"][0], charges=ids)


def _scaled_first_order(rdp: str) -> str:
    values = json.loads(rdp)
    values[0] *= 0.5
    return json.dumps(values)


@dataclass(frozen=True)
class Tamper:
    name: str
    apply: Callable[[Connection, Ledger], Callable[[Connection], None]]  # tampers, returns how to undo
    charge: str  # the charge that must be named
    first_bad_seq: int | None  # where silo b's chain first breaks (None: the chain itself is intact)
    silos: tuple[str, ...] = ("b",)  # the silos the problems must name, and no other


def edit_charge(
    column: str, forge: Callable[[Any], Any], label: str
) -> Callable[[Connection, Ledger], Callable[[Connection], None]]:
    def apply(connection: Connection, ledger: Ledger) -> Callable[[Connection], None]:
        charge_id = ledger.charges[label]
        if column == "rdp":  # every charge here shares one curve row (curves.py): the forger points this one at its own
            return repoint_curve(connection, charge_id, forge(charge_curve(connection, charge_id)))
        old = connection.execute(text(f"SELECT {column} FROM charges WHERE id = :id"), {"id": charge_id}).scalar_one()
        new = forge(ledger.a) if column == "silo_id" else forge(old)
        assert new != old
        connection.execute(text(f"UPDATE charges SET {column} = :v WHERE id = :id"), {"v": new, "id": charge_id})
        return lambda c: c.execute(text(f"UPDATE charges SET {column} = :v WHERE id = :id"), {"v": old, "id": charge_id})

    return apply


def edit_entry(column: str, new: Any, seq: int) -> Callable[[Connection, Ledger], Callable[[Connection], None]]:
    def apply(connection: Connection, ledger: Ledger) -> Callable[[Connection], None]:
        where = {"s": ledger.b, "q": seq}
        old = connection.execute(text(f"SELECT {column} FROM ledger_entries WHERE silo_id = :s AND seq = :q"), where).scalar_one()
        assert new != old
        connection.execute(text(f"UPDATE ledger_entries SET {column} = :v WHERE silo_id = :s AND seq = :q"), {**where, "v": new})
        return lambda c: c.execute(text(f"UPDATE ledger_entries SET {column} = :v WHERE silo_id = :s AND seq = :q"),
                                   {**where, "v": old})

    return apply


def delete_entry(seq: int) -> Callable[[Connection, Ledger], Callable[[Connection], None]]:
    def apply(connection: Connection, ledger: Ledger) -> Callable[[Connection], None]:
        where = {"s": ledger.b, "q": seq}
        row = dict(connection.execute(text("SELECT * FROM ledger_entries WHERE silo_id = :s AND seq = :q"), where)
                   .mappings().one())
        connection.execute(text("DELETE FROM ledger_entries WHERE silo_id = :s AND seq = :q"), where)
        columns = ", ".join(row)
        values = ", ".join(f":{k}" for k in row)
        return lambda c: c.execute(text(f"INSERT INTO ledger_entries ({columns}) VALUES ({values})"), row)

    return apply


TAMPERS = [
    Tamper(
        "charge mechanism JSON",
        edit_charge("mechanism", lambda v: v.replace('"noise_multiplier":1.0', '"noise_multiplier":9.0'), "b0"),
        "b0",
        3,
    ),
    Tamper("charge RDP vector", edit_charge("rdp", _scaled_first_order, "b3"), "b3", 8),
    # Would hand a committed charge's budget back if anything trusted the status column.
    Tamper("charge status committed→released", edit_charge("status", lambda v: "released", "b3"), "b3", None),
    Tamper("charge RDP vector unparsable", edit_charge("rdp", lambda v: "[0.1, oops", "b4"), "b4", 11),
    Tamper("charge status unknown", edit_charge("status", lambda v: "refunded", "b4"), "b4", None),
    Tamper("charge moved to another silo", edit_charge("silo_id", lambda a: a, "b4"), "b4", 11, ("a", "b")),
    Tamper("entry ε edited", edit_entry("epsilon_spent", 0.0, 9), "b3", 9),
    Tamper("entry event commit→release", edit_entry("event", "release", 10), "b2", 10),
    # b2's reserve entry goes; its commit entry (seq 10) stays, and the entry that fails to link is b3's.
    Tamper("reserve entry deleted, commit kept", delete_entry(7), "b2", 8),
    Tamper("last entry deleted", delete_entry(11), "b4", 11),
]


def test_every_tamper_is_named_over_http(ledger_url: str) -> None:
    with ServerProcess(database_url=ledger_url, admin_key=ADMIN_KEY, workers=1) as server:
        ledger = build_ledger(server.url)
        baseline = verify_chain(server.url)
        assert baseline == {"ok": True, "entries": 4 + 11, "first_bad_seq": None, "first_bad_silo_id": None,
                            "bad_charge_ids": [], "problems": []}
        silo_ids = {"a": ledger.a, "b": ledger.b}
        engine = create_engine(ledger_url)
        failures: list[str] = []
        try:
            for tamper in TAMPERS:
                with engine.begin() as connection:
                    undo = tamper.apply(connection, ledger)
                response = httpx.get(f"{server.url}/v1/audit/verify", headers=ADMIN, timeout=60)
                with engine.begin() as connection:
                    undo(connection)
                if response.status_code != 200:
                    failures.append(f"{tamper.name}: verify answered {response.status_code}: {response.text[:300]}")
                    continue
                report = response.json()
                named_silos = {int(p.split(":")[0].removeprefix("silo ")) for p in report["problems"]}
                expected_first = (None, None) if tamper.first_bad_seq is None else (ledger.b, tamper.first_bad_seq)
                if report["ok"] is not False:
                    failures.append(f"{tamper.name}: verified ok")
                if ledger.charges[tamper.charge] not in report["bad_charge_ids"]:
                    failures.append(f"{tamper.name}: {tamper.charge} not named: {report}")
                if ledger.charges["a0"] in report["bad_charge_ids"]:
                    failures.append(f"{tamper.name}: silo a's untouched charge named: {report}")
                if named_silos != {silo_ids[s] for s in tamper.silos}:
                    failures.append(f"{tamper.name}: problems name silos {named_silos}: {report['problems']}")
                if (report["first_bad_silo_id"], report["first_bad_seq"]) != expected_first:
                    failures.append(f"{tamper.name}: first bad {report['first_bad_silo_id'], report['first_bad_seq']}, "
                                    f"expected {expected_first}: {report['problems']}")
                if verify_chain(server.url) != baseline:
                    failures.append(f"{tamper.name}: not clean again after the row was put back")
        finally:
            engine.dispose()
        assert not failures, "\n".join(failures)
