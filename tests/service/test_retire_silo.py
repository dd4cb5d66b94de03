"""Retiring a mis-registered silo (issue 28): an admin's `retire` entry in the silo's chain and in the
transparency log, after which every approval on the silo is refused with one line quoting the reason,
while reservations made before are still settled and everything stays readable. An operator who takes
the retirement back in the database and charges again is caught by the auditor's `audit` and by the
silo's own `verify --receipts`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from dpledger.audit.outcome import Get
from dpledger.audit.transparency import RefusedError, audit, verify_receipts
from dpledger.cli import main
from dpledger.harness import running_server
from dpledger.wire.receipts import Receipt
from tests.conftest import ADMIN, ADMIN_KEY, bearer
from tests.service.rows import entries, logged, sql

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
SEARCH = {"trial": STEP, "mean_trials": 2, "distribution": {"kind": "geometric"}}
ROOT = Path(__file__).resolve().parents[2]
REASON = "registered with dataset_size 1000; the ward holds 100 records"


def sums(engine: Engine, silo_id: int) -> tuple[str, str]:
    row = sql(engine, "SELECT rdp_spent, rdp_committed FROM silos WHERE id = :id", id=silo_id).one()
    return row.rdp_spent, row.rdp_committed


def silo(client: TestClient, name: str) -> tuple[int, dict[str, str]]:
    created = client.post("/v1/silos", headers=ADMIN, json={"name": name, "epsilon": 3.0, "delta": 1e-5, "dataset_size": 1000})
    assert created.status_code == 201, created.text
    return created.json()["id"], bearer(created.json()["api_key"])


def charge(client: TestClient, silo_id: int, headers: dict[str, str], key: str) -> httpx.Response:
    return client.post(f"/v1/silos/{silo_id}/charges", headers=headers, json={"mechanism": STEP, "idempotency_key": key})


def retire(client: TestClient, silo_id: int, headers: dict[str, str] = ADMIN, reason: str = REASON) -> httpx.Response:
    return client.post(f"/v1/silos/{silo_id}/retire", headers=headers, json={"reason": reason})


def history(client: TestClient, silo_id: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = client.get(f"/v1/silos/{silo_id}/history", headers=ADMIN).json()
    return found


def refusal(silo_id: int, seq: int, reason: str = REASON) -> str:
    return f"silo {silo_id} is retired (entry {seq}: {reason}): it approves nothing; register a new silo"


def reader(client: TestClient, headers: dict[str, str]) -> Get:
    def get(path: str, params: dict[str, Any] | None) -> Any:
        response = client.get(path, params=params, headers=headers)
        if response.status_code >= 400:
            raise RefusedError(f"HTTP {response.status_code} from {path}: {response.text}")
        return response.json()

    return get


def test_only_an_admin_may_retire_a_silo(client: TestClient, engine: Engine) -> None:
    target, own = silo(client, "target")
    _, other = silo(client, "other")
    auditor = bearer(client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"])
    coordinator = bearer(client.post("/v1/keys", json={"role": "coordinator"}, headers=ADMIN).json()["api_key"])
    written = entries(engine)
    for headers, expected in ((own, 403), (other, 403), (auditor, 403), (coordinator, 403), ({}, 401),
                              (bearer("dpl_not-a-key"), 401)):
        assert retire(client, target, headers).status_code == expected
    assert entries(engine) == written  # no refusal wrote anything
    assert client.get(f"/v1/silos/{target}", headers=ADMIN).json()["retired_seq"] is None

    retired = retire(client, target)
    assert retired.status_code == 200, retired.text
    body = retired.json()
    assert (body["id"], body["name"], body["retired_seq"], body["retired_reason"]) == (target, "target", 2, REASON)
    assert entries(engine) == written + 1
    assert retire(client, 10**6).status_code == 404


@pytest.mark.parametrize(("body", "field", "says"), [
    ({}, "reason", "Field required"),
    ({"reason": ""}, "reason", "at least 1 character"),
    ({"reason": "x" * 501}, "reason", "at most 500 characters"),
    ({"reason": "   "}, "reason", "not only spaces"),
    ({"reason": "wrong size\nsilo 9 is fine"}, "reason", "one line of text"),
    ({"reason": 5}, "reason", "valid string"),
    ({"reason": "wrong size", "refund": True}, "refund", "Extra inputs"),
])
def test_a_missing_empty_or_too_long_reason_is_a_422_naming_it_and_writes_nothing(
    client: TestClient, engine: Engine, body: dict[str, Any], field: str, says: str
) -> None:
    target, _ = silo(client, "target")
    written = entries(engine)
    refused = client.post(f"/v1/silos/{target}/retire", headers=ADMIN, json=body)
    assert refused.status_code == 422, refused.text
    [problem] = refused.json()["detail"]
    assert problem["loc"] == ["body", field] and says in problem["msg"]
    assert entries(engine) == written
    assert sql(engine, "SELECT retired_seq, retired_reason FROM silos WHERE id = :id", id=target).one() == (None, None)
    # 500 characters on one line are a reason.
    assert retire(client, target, reason="x" * 500).json()["retired_reason"] == "x" * 500


def test_a_retired_silo_approves_nothing_and_still_settles_what_it_reserved_before(client: TestClient, engine: Engine) -> None:
    target, headers = silo(client, "target")
    committed, released = (charge(client, target, headers, key).json()["charge_id"] for key in ("c", "r"))
    seq = retire(client, target).json()["retired_seq"]
    assert seq == 5  # create, filter (fixed by the first charge), two reserves, then the retirement
    before = client.get(f"/v1/silos/{target}", headers=headers).json()
    spent, written = sums(engine, target), entries(engine)

    line = refusal(target, seq)
    refused = [
        charge(client, target, headers, "after"),
        client.post(f"/v1/silos/{target}/searches", headers=headers, json={**SEARCH, "idempotency_key": "s"}),
        client.post(f"/v1/silos/{target}/plan", headers=headers, json={"mechanism": {**STEP, "steps": 100}}),
        client.post(f"/v1/silos/{target}/calibrate", headers=headers, json={"batch_size": 10, "rounds": 2, "steps_per_round": 1}),
        client.post("/v1/quote/rounds", headers=headers,
                    json={"silo_id": target, "rounds": 2, "runs": [{"mechanism": STEP, "count": 2}]}),
        client.post(f"/v1/silos/{target}/seal", headers=ADMIN),
    ]
    for response in refused:
        assert response.status_code == 409, response.text
        assert response.json() == {"detail": line}
    assert entries(engine) == written and sums(engine, target) == spent  # the refusals wrote nothing
    after = client.get(f"/v1/silos/{target}", headers=headers).json()
    assert after == before and after["epsilon_spent"] > 0  # nothing refunded: ε spent as it was

    # A retry of a reservation made before is answered (a read), never a new approval.
    replay = charge(client, target, headers, "c")
    assert replay.status_code == 200 and replay.json()["replayed"] is True and replay.json()["charge_id"] == committed
    # A round that may have touched data is still committed; one that did not, released.
    assert client.post(f"/v1/charges/{committed}/commit", headers=headers).status_code == 200
    assert client.post(f"/v1/charges/{released}/release", headers=headers).status_code == 200
    assert [e["event"] for e in history(client, target)] == ["create", "filter", "reserve", "reserve", "retire", "commit",
                                                             "release"]
    detail = client.get(f"/v1/silos/{target}", headers=headers).json()
    assert detail["epsilon_committed"] == detail["epsilon_spent"] > 0 and detail["retired_seq"] == seq
    # Still refused after the settling, and reads keep working with the silo's own key.
    assert charge(client, target, headers, "later").json() == {"detail": line}
    for path in (f"/v1/silos/{target}/history", f"/v1/silos/{target}/charges", f"/v1/charges/{committed}"):
        assert client.get(path, headers=headers).status_code == 200
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


def test_retiring_twice_is_a_409_naming_the_first_retirement(client: TestClient, engine: Engine) -> None:
    target, _ = silo(client, "target")
    seq = retire(client, target).json()["retired_seq"]
    written = entries(engine)
    again = retire(client, target, reason="another reason")
    assert again.status_code == 409
    assert again.json() == {"detail": f"silo {target} is retired already (entry {seq}: {REASON})"}
    assert entries(engine) == written


def test_the_retire_entry_is_in_the_chain_and_the_log_and_an_honest_ledger_audits_clean(
    client: TestClient, engine: Engine
) -> None:
    target, headers = silo(client, "target")
    other, other_headers = silo(client, "other")
    reserved = charge(client, target, headers, "before").json()
    receipts = [Receipt(**reserved["receipt"])]
    retire(client, target)
    receipts.append(Receipt(**client.post(f"/v1/charges/{reserved['charge_id']}/commit", headers=headers).json()["receipt"]))
    assert charge(client, other, other_headers, "other").status_code == 201  # other silos are untouched

    last = history(client, target)[-2]
    assert (last["event"], last["subject"], last["charge_id"]) == ("retire", {"reason": REASON}, None)
    logged(client, engine)
    leaves = reader(client, headers)("/v1/log/leaves", {"start": 0, "limit": 100})
    records = [leaf["record"] for leaf in leaves if leaf["record"] is not None]
    assert sum('"event":"retire"' in r and REASON in r for r in records) == 1  # the log holds the reason it covers
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
    auditor = bearer(client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"])
    found = audit(reader(client, auditor), None)
    assert found.ok, found.problems
    checked = verify_receipts(reader(client, headers), receipts)
    assert checked.ok, checked.problems


def test_a_retirement_taken_back_in_the_database_is_refused_before_any_approval(client: TestClient, engine: Engine) -> None:
    target, headers = silo(client, "target")
    assert charge(client, target, headers, "before").status_code == 201
    seq = retire(client, target).json()["retired_seq"]
    # The operator nulls the retirement, keeping the reason (so the retire entry still hashes), and charges again:
    # the chain decides retired_seq (its retire entry), so the record is named before anything is approved.
    sql(engine, "UPDATE silos SET retired_seq = NULL WHERE id = :id", id=target)
    written = entries(engine)
    resumed = charge(client, target, headers, "after")
    assert resumed.status_code == 409, resumed.text
    assert resumed.json()["tampered"] == {"silo_id": target, "table": "silos", "entry_seq": seq, "entry_event": "retire"}
    assert resumed.json()["detail"].startswith(f"silo {target}'s record (the silos row) says it is in service, but entry "
                                               f"{seq} retired it: its retire entry (seq {seq}) decides it")
    assert entries(engine) == written
    report = client.get("/v1/audit/verify", headers=ADMIN).json()
    assert report["ok"] is False and report["bad_charge_ids"] == []
    assert report["problems"] == [f"silo {target}: entry {seq} retired the silo, but the silo's record says it is in service"]
    # Restored, it refuses as a retired silo does.
    sql(engine, "UPDATE silos SET retired_seq = :seq WHERE id = :id", seq=seq, id=target)
    assert charge(client, target, headers, "after").status_code == 409
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


@pytest.mark.parametrize(("edit", "why"), [
    ("UPDATE silos SET retired_reason = 'a kinder reason' WHERE id = :id",
     "no longer matches the hash of the entry that covers it: its retire entry (seq {seq}) covers it"),
    ("UPDATE silos SET retired_seq = 1 WHERE id = :id",
     "says it is retired at entry 1, but entry {seq} retired it: its retire entry (seq {seq}) decides it"),
    ("UPDATE silos SET retired_seq = retired_seq + 5 WHERE id = :id",
     "says it is retired at entry {moved}, but entry {seq} retired it: its retire entry (seq {seq}) decides it"),
])
def test_an_edited_retirement_is_named_as_tampered(client: TestClient, engine: Engine, edit: str, why: str) -> None:
    target, headers = silo(client, "target")
    seq = retire(client, target).json()["retired_seq"]
    sql(engine, edit, id=target)
    refused = client.get(f"/v1/silos/{target}", headers=headers)
    assert refused.status_code == 409
    assert refused.json()["detail"].startswith(f"silo {target}'s record (the silos row) " + why.format(seq=seq, moved=seq + 5))
    assert charge(client, target, headers, "after").status_code == 409
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is False


def test_a_retired_silos_name_stays_its_own(client: TestClient) -> None:
    target, _ = silo(client, "ward-7")
    taken = client.post("/v1/silos", headers=ADMIN, json={"name": "ward-7", "epsilon": 3.0, "delta": 1e-5, "dataset_size": 100})
    assert taken.status_code == 409 and taken.json() == {"detail": "a silo named 'ward-7' exists already"}
    retire(client, target)
    again = client.post("/v1/silos", headers=ADMIN, json={"name": "ward-7", "epsilon": 3.0, "delta": 1e-5, "dataset_size": 100})
    assert again.status_code == 409
    assert again.json() == {"detail": f"a silo named 'ward-7' exists already (silo {target}, retired: {REASON}); register "
                                      "the corrected silo under another name"}
    corrected = client.post("/v1/silos", headers=ADMIN,
                            json={"name": "ward-7b", "epsilon": 3.0, "delta": 1e-5, "dataset_size": 100})
    assert corrected.status_code == 201


def test_dpledger_silos_retire_end_to_end(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with running_server(database_url=f"sqlite:///{tmp_path}/l.db", admin_key=ADMIN_KEY) as url:
        created = httpx.post(f"{url}/v1/silos", headers=ADMIN,
                             json={"name": "ward", "epsilon": 3.0, "delta": 1e-5, "dataset_size": 1000}).json()
        own = bearer(created["api_key"])
        assert httpx.post(f"{url}/v1/silos/{created['id']}/charges", headers=own,
                          json={"mechanism": STEP, "idempotency_key": "k"}).status_code == 201
        monkeypatch.setenv("DPLEDGER_URL", url)
        monkeypatch.setenv("DPLEDGER_KEY", created["api_key"])
        assert main(["silos", "retire", str(created["id"]), "--reason", REASON]) == 2  # a silo's key may not
        assert "403 forbidden" in capsys.readouterr().err

        monkeypatch.setenv("DPLEDGER_KEY", ADMIN_KEY)
        assert main(["silos", "retire", str(created["id"]), "--reason", REASON]) == 0
        spent = httpx.get(f"{url}/v1/silos/{created['id']}", headers=ADMIN).json()["epsilon_spent"]
        assert capsys.readouterr().out == (
            f"silo {created['id']} 'ward' retired at entry 4: {REASON}. It approves nothing from now on (ε spent stays "
            f"{spent:.6g}, nothing is refunded); reservations made before are still committed or released; register the "
            "corrected silo under another name\n")
        assert main(["silos", "retire", str(created["id"]), "--reason", "again"]) == 2
        assert f"HTTP 409 from /v1/silos/{created['id']}/retire: silo {created['id']} is retired already (entry 4: " \
               f"{REASON})" in capsys.readouterr().err
        assert main(["silos", "retire", str(created["id"]), "--reason", ""]) == 2
        assert "HTTP 422" in (err := capsys.readouterr().err) and "reason: String should have at least 1 character" in err

        assert main(["silos", "list"]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split()[-1] == "state" and row.endswith("retired at entry 4")
        assert main(["silos", "show", str(created["id"])]) == 0
        assert capsys.readouterr().out.splitlines()[-1].split(None, 1) == ["retired", f"at entry 4: {REASON}"]
        refused = httpx.post(f"{url}/v1/silos/{created['id']}/charges", headers=own,
                             json={"mechanism": STEP, "idempotency_key": "k2"})
        assert refused.status_code == 409 and refused.json()["detail"] == refusal(created["id"], 4)


def test_the_dashboard_marks_a_retired_silo_on_the_overview_and_its_page(client: TestClient) -> None:
    target, headers = silo(client, "target")
    kept, _ = silo(client, "kept")
    assert charge(client, target, headers, "before").status_code == 201
    reason = "size <wrong> & budget"  # shown escaped, as every value from the database
    seq = retire(client, target, reason=reason).json()["retired_seq"]
    auditor = client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]
    signed = client.post("/dashboard/login", content=f"api_key={auditor}",
                         headers={"content-type": "application/x-www-form-urlencoded"}, follow_redirects=False)
    assert signed.status_code == 303

    overview = client.get("/dashboard").text
    row = re.search(rf'<tr data-silo-id="{target}".*?</tr>', overview).group(0)  # type: ignore[union-attr]
    assert (f'<span class="retired" data-retired-seq="{seq}">retired: size &lt;wrong&gt; &amp; budget</span>' in row
            and 'data-chain="ok"' in row and "data-epsilon-spent=" in row)  # its numbers, as they were
    assert 'class="retired"' not in re.search(rf'<tr data-silo-id="{kept}".*?</tr>', overview).group(0)  # type: ignore[union-attr]
    page = client.get(f"/dashboard/silos/{target}")
    assert page.status_code == 200
    assert (f'<p id="retired" class="alert" data-retired-seq="{seq}">This silo is retired (entry {seq}: size &lt;wrong&gt; '
            "&amp; budget): it approves nothing." in page.text)
    assert 'id="retired"' not in client.get(f"/dashboard/silos/{kept}").text


def test_the_operator_guides_retire_block_runs_as_written(tmp_path: Any) -> None:
    """docs/guides/operator.md's block, pasted into an empty folder against a served ledger that holds
    silos 1 to 3 (DPLEDGER_URL and DPLEDGER_ADMIN_KEY set, as an operator's shell has them)."""
    guide = (ROOT / "docs" / "guides" / "operator.md").read_text()
    heading = "## Retiring a mis-registered silo\n"
    block = guide.split(heading, 1)[1].split("```\n", 2)[1]
    with running_server(database_url=f"sqlite:///{tmp_path}/l.db", admin_key=ADMIN_KEY) as url:
        for n in range(3):
            assert httpx.post(f"{url}/v1/silos", headers=ADMIN, json={
                "name": f"ward-{n + 1}", "epsilon": 4.0, "delta": 1e-5, "dataset_size": 6740}).status_code == 201
        env = {k: v for k, v in os.environ.items() if not k.startswith("DPLEDGER_")}
        env |= {"DPLEDGER_URL": url, "DPLEDGER_ADMIN_KEY": ADMIN_KEY, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
        folder = tmp_path / "empty"
        folder.mkdir()
        done = subprocess.run(["bash", "-eu", "-c", block], cwd=folder, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        retired = httpx.get(f"{url}/v1/silos/3", headers=ADMIN).json()
        assert retired["retired_reason"] == "registered with dataset_size 6740; the ward holds 674 records"
        corrected = [s for s in httpx.get(f"{url}/v1/silos", headers=ADMIN).json() if s["name"] == "ward-3b"]
        assert [(c["epsilon"], c["delta"], c["dataset_size"], c["retired_seq"]) for c in corrected] == [(4.0, 1e-5, 674, None)]
