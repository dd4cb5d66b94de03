"""A silo's `verify --receipts`, alone, against the hostile operator of issue 27: it recomposes its ε
from the mechanisms of its own signed entries (through the filter its create entry fixed), checks
every head it holds against today's log, and asks the served budget, filter and ε. Each scenario
edits the SQLite file directly and lets the silo keep charging; the ledger of
tests/service/test_transparency.py is used (silo b: b0 committed, b1 released, b2 committed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from dpledger.audit.transparency import verify_receipts
from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.api.app import create_app
from dpledger.service.ledger import seals
from dpledger.service.settings import Settings
from dpledger.service.store import reserving
from dpledger.service.store.models import Silo
from dpledger.wire import merkle
from dpledger.wire.receipts import SignedTreeHead, is_fork
from tests.conftest import ADMIN, ADMIN_KEY, bearer
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon
from tests.service.test_transparency import STEP, Ledger, Operator, Party, build, problems, write_key

Q, SIGMA = STEP["batch_size"] / 1000, STEP["noise_multiplier"]


@pytest.fixture
def ledger(url: str, tmp_path: Path) -> Iterator[Ledger]:
    app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY, signing_key_file=write_key(tmp_path / "key.pem")))
    yield build(TestClient(app))
    app.state.engine.dispose()


@pytest.fixture
def operator(url: str) -> Iterator[Operator]:
    op = Operator(url)
    yield op
    op.dispose()


def keep_charging(ledger: Ledger, label: str) -> dict[str, Any]:
    return ledger.b.post(f"/v1/silos/{ledger.ids['b']}/charges", {"mechanism": STEP, "idempotency_key": label})


def b_epsilon(ledger: Ledger, steps: int) -> float:
    """What `steps` DP-SGD steps of b compose to through b's filter (dp-accounting's own RDP, read independently)."""
    detail = ledger.client.get(f"/v1/silos/{ledger.ids['b']}", headers=ADMIN).json()
    return proven_epsilon(filter_of(detail), dpsgd_curve([(Q, SIGMA, steps)]), delta=1e-5)


def test_an_honest_run_raises_no_alarm_and_checks_every_head(ledger: Ledger) -> None:
    for party, silo in ((ledger.a, "a"), (ledger.b, "b")):
        entries = len(ledger.client.get(f"/v1/silos/{ledger.ids[silo]}/history", headers=ADMIN).json())
        out = verify_receipts(party.get(), party.receipts)
        assert out.ok, problems(out)
        assert out.evidence == []
        heads = len({r.tree_head.tree_size for r in party.receipts})
        assert out.notes[0].startswith(f"{len(party.receipts)} receipts, {heads} distinct heads and {entries} entries")


def unchecked(session: Session, silo: Silo, *, key: reserving.AfterLock | None = None) -> int | None:
    """seals.check as a patched server would run it: the record is never checked, the key's charge still read."""
    return None if key is None else reserving.charge_by_key(session, silo_id=silo.id, idempotency_key=key.idempotency_key)


def test_a_lowered_running_sum_is_found_by_recomposing_the_entries_that_followed(
    ledger: Ledger, operator: Operator, monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = ledger.ids["b"]
    # Only the running sum: no entry, leaf or hash touched, so every check of the chain and the log holds.
    operator.sql("UPDATE silos SET rdp_spent = :empty WHERE id = :id", empty=RunningSum.empty(len(rdp.ORDERS)).to_json(), id=b)
    # The service recomputes the sum from the chain at load (ledger/replayed.py): refused, nothing written.
    refused = ledger.client.post(f"/v1/silos/{b}/charges", headers=ledger.b.headers,
                                 json={"mechanism": {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1},
                                       "idempotency_key": "refused"})
    assert refused.status_code == 409 and refused.json()["tampered"]["silo_id"] == b, refused.text
    assert "holds rdp_spent that the charges of its chain" in refused.json()["detail"]
    # An operator who also runs a server patched to skip that check: the silo alone still finds the lie.
    monkeypatch.setattr(seals, "check", unchecked)
    detail = ledger.client.get(f"/v1/silos/{b}", headers=ADMIN).json()
    assert detail["epsilon_spent"] == 0.0  # what the gate now approves against
    charge = keep_charging(ledger, "b3")  # approved and signed: it states the ε of b3 alone
    assert charge["epsilon_spent"] == pytest.approx(b_epsilon(ledger, 1), rel=1e-9)
    out = verify_receipts(ledger.b.get(), ledger.b.receipts)
    stated, composed = b_epsilon(ledger, 1), b_epsilon(ledger, 3)  # b0, b2 and b3 are live
    reserve = f"silo {b} entry {charge['receipt']['seq']} (reserve of charge {charge['charge_id']})"
    assert f"{reserve} states ε={stated:.6g}, but its charges' mechanisms compose to ε={composed:.6g}" in problems(out)
    assert f"silo {b}: the ledger says ε={stated:.6g} is spent now, but the mechanisms of its signed entries compose " \
           f"to ε={composed:.6g}" in problems(out)
    assert "FORK" not in problems(out)  # the log itself is honest: the lie is in what the entries state
    (proof,) = out.evidence
    b_leaves = [leaf["log_index"] for leaf in ledger.client.get("/v1/log/leaves", params={"silo_id": b}, headers=ADMIN).json()]
    b3 = ledger.b.receipts[-1]  # as the silo completed it: in the log, the head just after it
    assert b3.seq == charge["receipt"]["seq"] and b3.tree_head is not None
    assert proof["head"]["tree_size"] == b3.tree_head.tree_size  # b3 is the log's last entry
    assert [e["log_index"] for e in proof["entries"]] == b_leaves and len(b_leaves) == charge["receipt"]["seq"]
    assert verify_receipts(ledger.a.get(), ledger.a.receipts).ok  # silo a was not touched


def one_order(spec: str) -> str:
    """The filter with the whole δ on its first order: a smaller ε read wherever that order is the best."""
    parsed = json.loads(spec)
    return json.dumps({"orders": parsed["orders"][:1], "weights": [1.0], "source": parsed["source"]})


@pytest.mark.parametrize("column", ["epsilon", "filter_spec"])
def test_a_budget_or_filter_edited_in_place_is_found_whether_or_not_the_hashes_were_recomputed(
    ledger: Ledger, operator: Operator, column: str
) -> None:
    b = ledger.ids["b"]
    with operator.engine.begin() as connection:
        old = connection.execute(text(f"SELECT {column} FROM silos WHERE id = :id"), {"id": b}).scalar_one()
        new = old * 2 if column == "epsilon" else one_order(old)
        connection.execute(text(f"UPDATE silos SET {column} = :v WHERE id = :id"), {"v": new, "id": b})
    # Left as it is, the service itself names the record and refuses; the silo's check reports it.
    refused = ledger.client.post(f"/v1/silos/{b}/charges", headers=ledger.b.headers,
                                 json={"mechanism": STEP, "idempotency_key": "b3"})
    history = [e["event"] for e in ledger.client.get(f"/v1/silos/{b}/history", headers=ADMIN).json()]
    covering = "filter" if column == "filter_spec" and "filter" in history else "create"  # a first charge may fix it
    assert refused.status_code == 409 and refused.json()["tampered"]["entry_event"] == covering
    out = verify_receipts(ledger.b.get(), ledger.b.receipts)
    assert f"silo {b}: the ledger refuses to serve the silo: HTTP 409" in problems(out)
    # Every hash recomputed and the log rebuilt: the service is fooled and b keeps charging, but every
    # head b holds covers its create entry, and none of them is consistent with the rebuilt log.
    operator.rebuild()
    keep_charging(ledger, "b3")
    out = verify_receipts(ledger.b.get(), ledger.b.receipts)
    oldest = min(r.tree_head.tree_size for r in ledger.b.receipts)
    assert f"FORK: two signed heads of size {oldest} with different roots (the log before it was rewritten, and after)" \
           in problems(out)
    for evidence in out.evidence:
        assert is_fork(*(SignedTreeHead(**h) for h in evidence["heads"]), bytes.fromhex(evidence["public_key"]))


def test_a_log_rebuilt_and_resigned_is_found_by_a_silo_that_kept_charging(ledger: Ledger, operator: Operator) -> None:
    """Silo a's a0 now claims three times the noise, everything recomputed; silo b, untouched, charges on
    and its newest receipt is signed over the rebuilt log: its older heads contradict it."""
    operator.edit_mechanism(ledger.ids["a0"], '"noise_multiplier":1.0', '"noise_multiplier":3.0')
    operator.rebuild()
    keep_charging(ledger, "b3")
    newest = ledger.b.receipts[-1]
    assert verify_receipts(ledger.b.get(), [newest]).ok  # the newest head alone is consistent: the old check passed
    out = verify_receipts(ledger.b.get(), ledger.b.receipts)
    assert not out.ok
    first_touched = min(r.tree_head.tree_size for r in ledger.b.receipts if r.tree_head.tree_size > 2)  # a0 is index 2
    assert f"FORK: two signed heads of size {first_touched} with different roots" in problems(out)
    assert "reads differently" not in problems(out)  # b's own entries are as they were signed
    (evidence,) = out.evidence
    assert is_fork(*(SignedTreeHead(**h) for h in evidence["heads"]), bytes.fromhex(evidence["public_key"]))


def test_a_silo_may_batch_proofs_and_list_leaves_of_its_own_entries_only(ledger: Ledger) -> None:
    own = ledger.b.receipts[0].log_index
    other = ledger.a.receipts[0].log_index
    get = ledger.client.get
    answer = get("/v1/log/proofs", params={"inclusion": f"{own}", "consistency": "1,5"}, headers=ledger.b.headers).json()
    head = SignedTreeHead(**get("/v1/log/head", headers=ledger.b.headers).json())
    (included,) = answer["inclusion"]
    merkle.verify_inclusion(index=own, size=head.tree_size, leaf=bytes.fromhex(ledger.b.receipts[0].leaf_hash),
                            path=[bytes.fromhex(p) for p in included["path"]], root_hash=bytes.fromhex(head.root_hash))
    assert [c["first"] for c in answer["consistency"]] == [1, 5] and answer["tree_size"] == head.tree_size
    assert get("/v1/log/proofs", params={"inclusion": f"{own},{other}"}, headers=ledger.b.headers).status_code == 403
    assert get("/v1/log/leaves", params={"silo_id": ledger.ids["a"]}, headers=ledger.b.headers).status_code == 403
    refused = get("/v1/log/proofs", params={"inclusion": "1,x"}, headers=ADMIN)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "inclusion"]
    past = get("/v1/log/proofs", params={"inclusion": "99"}, headers=ADMIN)
    assert past.status_code == 422 and f"must be below the tree size {head.tree_size}" in past.json()["detail"][0]["msg"]


def test_a_silo_with_a_plan_beside_its_filter_recomposes_both_branches_and_the_branchs_end(ledger: Ledger) -> None:
    """Registered without a horizon, a two-step plan declared: its steps read the plan's ε (lower
    than the filter's), a charge off the plan ends the branch, and the plan's next step is then read
    by the filter alone. The silo's receipts recompose every stated ε, whichever branch gave it."""
    client = ledger.client
    created = client.post("/v1/silos", json={"name": "p", "epsilon": 10.0, "delta": 1e-5, "dataset_size": 1000},
                          headers=ADMIN).json()
    party, silo = Party(client, bearer(created["api_key"])), created["id"]
    plan = client.post(f"/v1/silos/{silo}/plan", json={"mechanism": {**STEP, "steps": 3}}, headers=ADMIN).json()
    spent = []
    for label, mechanism in [("p0", {**STEP, "steps": 2}), ("p1", STEP), ("off", {**STEP, "noise_multiplier": 2.0}),
                             ("late", STEP)]:
        spent.append(party.post(f"/v1/silos/{silo}/charges", {"mechanism": mechanism, "idempotency_key": label})["epsilon_spent"])
    pairs = filter_of(client.get(f"/v1/silos/{silo}", headers=ADMIN).json())
    assert spent[1] == pytest.approx(plan["epsilon"], rel=1e-12)  # the whole plan: its PLD ε, below the filter's
    assert plan["epsilon"] < proven_epsilon(pairs, dpsgd_curve([(Q, SIGMA, 3)]), delta=1e-5)
    late = proven_epsilon(pairs, dpsgd_curve([(Q, SIGMA, 4), (Q, 2.0, 1)]), delta=1e-5)
    assert spent[3] == pytest.approx(late, rel=1e-9)  # the branch ended: the filter alone
    out = verify_receipts(party.get(), party.receipts)
    assert out.ok, problems(out)
