"""`dpledger silos|history|verify` against a real server over a socket, compared with the API's JSON."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from sqlalchemy import create_engine, text

from dpledger.cli import main
from dpledger.harness import running_server
from dpledger.people.commands import number
from tests import gate_oracle
from tests.conftest import ADMIN, ADMIN_KEY

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1}


@dataclass(frozen=True)
class Ledger:
    url: str
    database_url: str
    silo_ids: list[int]
    silo_keys: list[str]
    charge_ids: list[int]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    database_url = f"sqlite:///{tmp_path_factory.mktemp('cli')}/l.db"
    with running_server(database_url=database_url, admin_key=ADMIN_KEY) as url:
        ids, keys, charge_ids = [], [], []
        for name, epsilon in (("clinic", 2.0), ("bank", 8.0)):
            body = {"name": name, "epsilon": epsilon, "delta": 1e-5, "dataset_size": 1000}
            created = httpx.post(f"{url}/v1/silos", json=body, headers=ADMIN).json()
            ids.append(created["id"])
            keys.append(created["api_key"])
        silo_headers = {"Authorization": f"Bearer {keys[0]}"}
        for i in range(3):
            body = {"mechanism": STEP, "idempotency_key": f"r{i}", "job_id": "ward-7", "round": i}
            response = httpx.post(f"{url}/v1/silos/{ids[0]}/charges", json=body, headers=silo_headers)
            assert response.status_code == 201, response.text
            charge_ids.append(response.json()["charge_id"])
        assert httpx.post(f"{url}/v1/charges/{charge_ids[0]}/commit", headers=silo_headers).status_code == 200
        assert httpx.post(f"{url}/v1/charges/{charge_ids[1]}/release", headers=silo_headers).status_code == 200
        yield Ledger(url, database_url, ids, keys, charge_ids)


@pytest.fixture
def as_admin(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    monkeypatch.setenv("DPLEDGER_URL", ledger.url)
    monkeypatch.setenv("DPLEDGER_KEY", ADMIN_KEY)
    return ledger


def api(ledger: Ledger, path: str) -> httpx.Response:
    response = httpx.get(f"{ledger.url}{path}", headers=ADMIN)
    assert response.status_code == 200
    return response


def test_silos_list_prints_the_apis_numbers(as_admin: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["silos", "list"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()

    assert header.split() == ["id", "name", "ε", "budget", "δ", "ε", "spent", "remaining", "state"]
    silos = api(as_admin, "/v1/silos").json()
    assert [row.split() for row in rows] == [
        [str(s["id"]), s["name"], number(s["epsilon"]), number(s["delta"]), number(s["epsilon_spent"]),
         number(s["epsilon"] - s["epsilon_spent"]),
         *(["in", "service"] if s["retired_seq"] is None else ["retired", "at", "entry", str(s["retired_seq"])])]
        for s in silos
    ]
    assert silos[0]["epsilon_spent"] > 0 and silos[1]["epsilon_spent"] == 0.0


def test_silos_list_and_show_json_are_the_apis_json(as_admin: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["silos", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == api(as_admin, "/v1/silos").json()
    silo_id = as_admin.silo_ids[0]
    assert main(["silos", "show", str(silo_id), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == api(as_admin, f"/v1/silos/{silo_id}").json()


def test_silos_show_prints_every_field_of_the_detail(as_admin: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    silo_id = as_admin.silo_ids[0]
    assert main(["silos", "show", str(silo_id)]) == 0
    shown = dict(line.rsplit(None, 1) for line in capsys.readouterr().out.splitlines())

    detail = api(as_admin, f"/v1/silos/{silo_id}").json()
    assert shown["name"] == "clinic"
    assert shown["ε budget"] == number(detail["epsilon"])
    assert shown["ε spent (the gate's)"] == number(detail["epsilon_spent"])
    assert shown["ε spent (dp-accounting, reference)"] == number(detail["epsilon_dp_accounting"])
    assert shown["ε committed"] == number(detail["epsilon_committed"])
    assert shown["ε remaining"] == number(detail["epsilon_remaining"])
    assert shown["zCDP ρ"] == number(detail["rho"])
    assert shown["dataset size"] == "1000"
    assert detail["epsilon_committed"] < detail["epsilon_spent"]  # one reserved charge is still open


def test_history_table_and_csv_match_the_apis_history(as_admin: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    silo_id = as_admin.silo_ids[0]
    entries = api(as_admin, f"/v1/silos/{silo_id}/history").json()

    assert main(["history", str(silo_id)]) == 0
    _, *rows = capsys.readouterr().out.splitlines()
    assert [row.split()[:2] for row in rows] == [[str(e["seq"]), e["event"]] for e in entries]
    assert [row.split()[-3] for row in rows] == [number(e["epsilon_spent"]) for e in entries]
    assert [row.split()[-2] for row in rows] == [number(e["epsilon_dp_accounting"]) for e in entries]

    assert main(["history", str(silo_id), "--csv"]) == 0
    out = capsys.readouterr().out
    from_api = list(csv.DictReader(io.StringIO(api(as_admin, f"/v1/silos/{silo_id}/history?format=csv").text)))
    parsed = list(csv.DictReader(io.StringIO(out)))
    # The API's CSV, but its rounds counted from 1, as the table above and every line of `train` count them.
    assert [{**r, "round": str(int(r["round"]) + 1) if r["round"] else ""} for r in from_api] == parsed
    assert [e["round"] for e in entries if e["round"] is not None] and out.count("\r\n") == len(entries) + 1
    assert [int(r["seq"]) for r in parsed] == [e["seq"] for e in entries]
    assert [r["hash"] for r in parsed] == [e["hash"] for e in entries]
    assert [float(r["epsilon_spent"]) for r in parsed] == [e["epsilon_spent"] for e in entries]
    charged = [r for r in parsed if r["charge_id"]]
    assert {int(r["charge_id"]) for r in charged} == set(as_admin.charge_ids)
    assert {r["job_id"] for r in charged} == {"ward-7"}
    # registered (no horizon), its filter fixed by its first charge, three reserved, one committed, one released
    assert len(entries) == 1 + 1 + 3 + 2 and entries[1]["event"] == "filter"


def test_verify_exits_0_on_an_intact_chain_and_1_after_an_edit(as_admin: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {api(as_admin, '/v1/audit/verify').json()['entries']} entries")

    target = as_admin.charge_ids[2]
    engine = create_engine(as_admin.database_url)
    with engine.begin() as connection:
        original = connection.execute(text("SELECT job_id FROM charges WHERE id = :id"), {"id": target}).scalar_one()
        connection.execute(text("UPDATE charges SET job_id = 'forged' WHERE id = :id"), {"id": target})
    try:
        assert main(["verify"]) == 1
        out = capsys.readouterr().out
        report = api(as_admin, "/v1/audit/verify").json()
        assert out.startswith("BROKEN:") and f"edited charges [{target}]" in out
        assert report["bad_charge_ids"] == [target]
        for problem in report["problems"]:
            assert f"  - {problem}" in out.splitlines()
    finally:
        with engine.begin() as connection:
            connection.execute(text("UPDATE charges SET job_id = :v WHERE id = :id"), {"v": original, "id": target})
        engine.dispose()
    assert main(["verify"]) == 0


def test_a_silo_key_reading_everything_gets_403_or_404_and_exit_2(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DPLEDGER_URL", ledger.url)
    monkeypatch.setenv("DPLEDGER_KEY", ledger.silo_keys[0])
    expected = {"silos": "dpledger: 403 forbidden:", "verify": "dpledger: 403 forbidden:",
                # another silo's id is not this key's to see: "not found", like an id that names none
                "history": f"dpledger: HTTP 404 from /v1/silos/{ledger.silo_ids[1]}/history: silo {ledger.silo_ids[1]} not found"}
    for argv in (["silos", "list"], ["verify"], ["history", str(ledger.silo_ids[1])]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        (line,) = captured.err.splitlines()
        assert line.startswith(expected[argv[0]])
        assert ledger.silo_keys[0] not in line
    assert main(["silos", "show", str(ledger.silo_ids[0])]) == 0  # its own silo is readable


def test_a_missing_or_unknown_key_or_no_server_is_one_line_and_exit_2(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DPLEDGER_URL", ledger.url)
    monkeypatch.delenv("DPLEDGER_KEY", raising=False)
    assert main(["silos", "list"]) == 2
    assert capsys.readouterr().err == "dpledger: DPLEDGER_KEY is not set: export an admin, auditor or silo API key\n"

    monkeypatch.setenv("DPLEDGER_KEY", "dpl_guess")
    assert main(["verify"]) == 2
    assert capsys.readouterr().err == "dpledger: 401 unauthorized: DPLEDGER_KEY was refused (unknown or revoked API key)\n"

    monkeypatch.setenv("DPLEDGER_KEY", ADMIN_KEY)
    assert main(["silos", "show", "999"]) == 2
    assert capsys.readouterr().err == "dpledger: HTTP 404 from /v1/silos/999: silo 999 not found\n"

    monkeypatch.setenv("DPLEDGER_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert main(["silos", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpledger: cannot reach the ledger at http://127.0.0.1:9 (DPLEDGER_URL):")
    assert err.count("\n") == 1


def test_charges_list_open_and_release_recover_a_stranded_reservation(
    as_admin: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 13, item 4: a worker that crashed leaves reservations; the admin lists the open ones and
    releases the one whose round provably never ran. A silo-chosen job id is shown, never obeyed."""
    created = httpx.post(f"{as_admin.url}/v1/silos", headers=ADMIN,
                         json={"name": "stranded", "epsilon": 5.0, "delta": 1e-5, "dataset_size": 1000}).json()
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    hostile = "job\x1b[2K\x1b[1A\rok"
    ids = []
    for i in range(2):
        body = {"mechanism": STEP, "idempotency_key": f"s{i}", "job_id": hostile, "round": i}
        ids.append(httpx.post(f"{as_admin.url}/v1/silos/{created['id']}/charges", json=body, headers=headers).json()["charge_id"])
    job = httpx.post(f"{as_admin.url}/v1/jobs", json={"name": "j", "silo_ids": [created["id"]]}, headers=ADMIN).json()["job_id"]
    norm = {"silo_id": created["id"], "l2_norm": 1.0, "charge_id": ids[1]}
    assert httpx.post(f"{as_admin.url}/v1/jobs/{job}/rounds/1/norms", json=norm, headers=headers).status_code == 201

    assert main(["charges", "list", str(created["id"]), "--open"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["charge", "status"]
    assert [row.split()[:3] for row in rows] == [[str(c), "reserved", "job\\x1b[2K\\x1b[1A\\x0dok"] for c in ids]
    assert [row.split()[3] for row in rows] == ["1", "2"]  # the API's round indices 0 and 1, read from 1

    assert main(["charges", "release", str(ids[0])]) == 0
    assert capsys.readouterr().out.startswith(f"charge {ids[0]} released; silo ε spent now ")
    assert main(["charges", "release", str(ids[1])]) == 2  # its round reported a norm: fail closed
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dpledger: HTTP 409") and "may only be committed" in line
    assert main(["charges", "list", str(created["id"]), "--open"]) == 0
    assert [row.split()[0] for row in capsys.readouterr().out.splitlines()[1:]] == [str(ids[1])]
    assert main(["history", str(created["id"])]) == 0
    history = capsys.readouterr().out
    assert "\x1b" not in history and "\r" not in history and "job\\x1b[2K\\x1b[1A\\x0dok" in history
def test_silos_create_prints_the_new_silos_key_alone_and_that_key_reads_its_silo(
    as_admin: Ledger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["silos", "create", "ward-9", "--epsilon", "3", "--delta", "1e-6", "--dataset-size", "450"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert out == key + "\n" and key.startswith("dpl_")
    silo = httpx.get(f"{as_admin.url}/v1/silos", headers=ADMIN).json()[-1]
    assert (silo["name"], silo["epsilon"], silo["delta"], silo["dataset_size"]) == ("ward-9", 3.0, 1e-6, 450)
    assert err.startswith(f"silo {silo['id']} 'ward-9' created: ε = 3, δ = 1e-06, dataset_size = 450")
    own = httpx.get(f"{as_admin.url}/v1/silos/{silo['id']}", headers={"Authorization": f"Bearer {key}"})
    assert own.status_code == 200 and own.json()["epsilon_spent"] == 0.0

    # A bad field is the API's 422 reduced to the field and the reason; nothing is created.
    assert main(["silos", "create", "ward-10", "--epsilon", "-1", "--delta", "1e-6", "--dataset-size", "450"]) == 2
    line = capsys.readouterr().err
    assert line.startswith("dpledger: HTTP 422 from /v1/silos: epsilon:") and line.count("\n") == 1
    assert [s["name"] for s in httpx.get(f"{as_admin.url}/v1/silos", headers=ADMIN).json()].count("ward-10") == 0

    # The workload it expects fixes its filter's committed order: where that DP-SGD, run until it spends
    # ε, reads the least (checked against the same search over the published filter's orders).
    args = ["--epsilon", "3", "--delta", "1e-5", "--dataset-size", "1000", "--horizon-batch", "100", "--horizon-noise", "1.2"]
    assert main(["silos", "create", "ward-12", *args]) == 0
    capsys.readouterr()
    twelve = httpx.get(f"{as_admin.url}/v1/silos", headers=ADMIN).json()[-1]
    published = httpx.get(f"{as_admin.url}/v1/silos/{twelve['id']}", headers=ADMIN).json()["filter"]
    assert published["source"] == "horizon" and published["weights"][0] > 0.5  # the end of its path holds the most
    step = gate_oracle.dpsgd_curve([(0.1, 1.2, 1)])
    steps = 1
    while gate_oracle.proven_epsilon([(published["orders"][0], 1.0)], step * (steps + 1), delta=1e-5) <= 3:
        steps += 1
    spent = step * steps  # about the budget's worth of that DP-SGD: the committed order is its best
    best = min(gate_oracle.ORDERS, key=lambda a: gate_oracle.proven_epsilon([(a, 1.0)], spent, delta=1e-5))
    # Within two grid orders: the heaviest share reads the path's last stretch (96% of it to its end).
    assert abs(gate_oracle.ORDERS.index(best) - gate_oracle.ORDERS.index(published["orders"][0])) <= 2
    assert main(["silos", "create", "ward-13", "--horizon-batch", "100", *args[:6]]) == 2
    assert "go together" in capsys.readouterr().err

    # Only an admin may register a silo.
    monkeypatch.setenv("DPLEDGER_KEY", as_admin.silo_keys[1])
    assert main(["silos", "create", "ward-11", "--epsilon", "1", "--delta", "1e-6", "--dataset-size", "10"]) == 2
    assert capsys.readouterr().err.startswith("dpledger: 403 forbidden: this key may not write /v1/silos")


def test_silos_seal_accepts_a_tampered_record_once(as_admin: Ledger, capsys: pytest.CaptureFixture[str]) -> None:
    created = httpx.post(f"{as_admin.url}/v1/silos", headers=ADMIN,
                         json={"name": "edited", "epsilon": 2.0, "delta": 1e-5, "dataset_size": 1000,
                               "horizon": STEP}).json()
    assert main(["silos", "seal", str(created["id"])]) == 2  # nothing is broken: nothing to seal
    assert "there is nothing to seal" in capsys.readouterr().err
    engine = create_engine(as_admin.database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE silos SET epsilon = 4.0 WHERE id = :i"), {"i": created["id"]})
    engine.dispose()
    assert httpx.get(f"{as_admin.url}/v1/silos/{created['id']}", headers=ADMIN).status_code == 409

    assert main(["silos", "seal", str(created["id"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"silo {created['id']} 'edited' sealed as it stands: ε = 4, δ = 1e-05")
    detail = httpx.get(f"{as_admin.url}/v1/silos/{created['id']}", headers=ADMIN)
    assert detail.status_code == 200 and detail.json()["epsilon"] == 4.0
    history = httpx.get(f"{as_admin.url}/v1/silos/{created['id']}/history", headers=ADMIN).json()
    assert history[-1]["event"] == "seal"
