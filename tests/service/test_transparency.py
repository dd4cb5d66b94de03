"""The transparency log against a hostile operator: each test edits the database directly (SQL
through SQLAlchemy on the test's SQLite file), recomputing every hash it can (the chain, the
running sums, the ε of each entry, the Merkle leaves and subtrees), so that `/v1/audit/verify`
says ok; then a silo holding its receipts and an auditor holding an earlier head must each find it.

The ledger used throughout (silo a, silo b; in this order of requests):
  a0 reserve, b0 reserve, b0 commit, a0 commit, b1 reserve, b1 release, b2 reserve, b2 commit,
  a1 reserve, a's search (a repeat_and_select reserve)
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from alembic import command
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import MetaData, create_engine, delete, select, text
from sqlalchemy.orm import Session

from dpledger.audit.outcome import Get
from dpledger.audit.transparency import RefusedError, audit, verify_receipts
from dpledger.cli import main
from dpledger.harness import running_server
from dpledger.service.accounting import rdp
from dpledger.service.accounting.running_sum import RunningSum, curve_from_json, curve_to_json
from dpledger.service.api.app import create_app
from dpledger.service.ledger import chain, gate, transparency
from dpledger.service.ledger.signer import SigningKeyError
from dpledger.service.settings import Settings
from dpledger.service.store import curves
from dpledger.service.store.db import alembic_config
from dpledger.service.store.models import Charge, Curve, LedgerEntry, LogLeaf, LogNode, LogState, Silo
from dpledger.wire import merkle, receipt_store
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import EntryEvent
from dpledger.wire.mechanisms import Mechanism
from dpledger.wire.receipts import HeadError, PublicKey, Receipt, SignedTreeHead, check_receipt, is_fork
from tests.conftest import ADMIN, ADMIN_KEY, bearer
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
SEARCH = {"trial": STEP, "mean_trials": 2, "distribution": {"kind": "geometric"}}


def write_key(path: Path) -> Path:
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    return path


@pytest.fixture
def key(tmp_path: Path) -> Path:
    return write_key(tmp_path / "log-key.pem")


@dataclass
class Party:
    """Someone with a key who reads the log: a silo (with its receipts) or the auditor."""

    client: TestClient
    headers: dict[str, str]
    receipts: list[Receipt] = field(default_factory=list)

    def get(self) -> Get:
        def get(path: str, params: dict[str, Any] | None) -> Any:
            response = self.client.get(path, params=params, headers=self.headers)
            if response.status_code >= 400:
                raise RefusedError(f"HTTP {response.status_code} from {path}: {response.text}")
            return response.json()

        return get

    promises: list[Receipt] = field(default_factory=list)  # the receipts as the answers carried them

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The answer; its receipt kept as it came (a promise) and as the silo completes it: waiting
        for the sequencer, then the log's head and the path to it (the head just after the entry,
        as requests here come one at a time)."""
        response = self.client.post(path, json=body, headers=self.headers)
        assert response.status_code in (200, 201), response.text
        data: dict[str, Any] = response.json()
        promised = Receipt(**data["receipt"])
        self.promises.append(promised)
        completed = self.ledger_client().complete(promised)
        assert completed is not None, f"not sequenced by the promised deadline: {promised}"
        self.receipts.append(completed)
        return data

    def ledger_client(self) -> LedgerClient:
        return LedgerClient("http://testserver", self.headers["Authorization"].removeprefix("Bearer "),
                            http=self.client, receipts=False)


@dataclass
class Ledger:
    client: TestClient
    a: Party
    b: Party
    auditor: Party
    ids: dict[str, int]  # silo and charge ids by label


def build(client: TestClient) -> Ledger:
    ids: dict[str, int] = {}
    parties = {}
    for name in ("a", "b"):
        # A declared horizon: the chain holds no filter entry, so the positions below are the charges'.
        created = client.post("/v1/silos", json={"name": name, "epsilon": 10.0, "delta": 1e-5, "dataset_size": 1000,
                                                 "horizon": STEP}, headers=ADMIN).json()
        ids[name] = created["id"]
        parties[name] = Party(client, bearer(created["api_key"]))
    auditor_key = client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]

    def reserve(label: str) -> None:
        body = {"mechanism": STEP, "idempotency_key": label, "job_id": "j", "round": len(ids)}
        ids[label] = parties[label[0]].post(f"/v1/silos/{ids[label[0]]}/charges", body)["charge_id"]

    def settle(label: str, action: str) -> None:
        parties[label[0]].post(f"/v1/charges/{ids[label]}/{action}")

    for label, action in [("a0", None), ("b0", None), ("b0", "commit"), ("a0", "commit"), ("b1", None),
                          ("b1", "release"), ("b2", None), ("b2", "commit"), ("a1", None)]:
        reserve(label) if action is None else settle(label, action)
    ids["a_search"] = parties["a"].post(f"/v1/silos/{ids['a']}/searches", {**SEARCH, "idempotency_key": "s"})["charge_id"]
    return Ledger(client, parties["a"], parties["b"], Party(client, bearer(auditor_key)), ids)


@pytest.fixture
def app_over(url: str, key: Path) -> Iterator[Any]:
    apps = []

    def make(database_url: str = url, signing_key: Path | None = key) -> TestClient:
        app = create_app(Settings(database_url=database_url, admin_key=ADMIN_KEY, signing_key_file=signing_key))
        apps.append(app)
        return TestClient(app)

    yield make
    for app in apps:
        app.state.engine.dispose()


@pytest.fixture
def ledger(app_over: Any) -> Ledger:
    return build(app_over())


def first_audit(auditor: Party) -> dict[str, Any]:
    """The auditor's first look: all checks hold; its head file as `dpledger audit` writes it."""
    out = audit(auditor.get(), None)
    assert out.ok, out.problems
    assert out.head is not None
    key = PublicKey(**auditor.get()("/v1/log/public-key", None)).public_key
    return {"public_key": key, "head": out.head.model_dump()}


def chain_ok(client: TestClient) -> bool:
    report = client.get("/v1/audit/verify", headers=ADMIN).json()
    return bool(report["ok"])


# --- the hostile operator ----------------------------------------------------------------------

class Operator:
    """Edits the rows, then puts every derived value back in line with the edit, with the ledger's
    own code (the operator has it): RDP vectors from mechanisms, each entry's ε, the running sums,
    every chain hash, and the Merkle log rebuilt leaf by leaf."""

    def __init__(self, database_url: str) -> None:
        self.engine = create_engine(database_url)

    def sql(self, statement: str, **params: Any) -> None:
        with self.engine.begin() as connection:
            connection.execute(text(statement), params)

    def rebuild(self, *, recompute_epsilon: bool = True) -> None:
        adapter: TypeAdapter[Any] = TypeAdapter(Mechanism)
        with Session(self.engine) as session, session.begin():
            for silo in session.scalars(select(Silo)):
                charges = {c.id: c for c in session.scalars(select(Charge).where(Charge.silo_id == silo.id))}
                if recompute_epsilon:
                    for c in charges.values():  # a curve row of its own (curves.py keys it), and the charge at it
                        c.rdp = curve_to_json(rdp.certified_curve(adapter.validate_json(c.mechanism)))
                        c.curve_hash = curves.key(c.rdp)
                        if session.get(Curve, c.curve_hash) is None:
                            session.add(Curve(hash=c.curve_hash, rdp=c.rdp))
                            session.flush()
                spent = committed = RunningSum.empty(len(rdp.ORDERS))
                prev, seq = chain.GENESIS, 0
                for e in session.scalars(select(LedgerEntry).where(LedgerEntry.silo_id == silo.id).order_by(LedgerEntry.seq)):
                    c = charges.get(e.charge_id) if e.charge_id is not None else None
                    if recompute_epsilon and c is not None:
                        curve = curve_from_json(c.rdp)
                        if e.event == "reserve":
                            spent = spent.add(curve)
                        elif e.event == "release":
                            spent = spent.subtract(curve)
                        else:
                            committed = committed.add(curve)
                        e.epsilon_spent = gate.reading(silo, spent).epsilon
                        if e.event == "reserve":
                            c.epsilon_spent_after = e.epsilon_spent
                    e.prev_hash = prev
                    e.hash = chain.entry_hash(e, subject=chain.subject(EntryEvent(e.event), silo, c))
                    prev, seq = e.hash, e.seq
                silo.chain_head, silo.chain_seq = prev, seq
                if recompute_epsilon:
                    silo.rdp_spent, silo.rdp_committed = spent.to_json(), committed.to_json()
            session.flush()
            # The log rebuilt leaf by leaf, keeping every untouched entry's salt (and so its leaf hash).
            salts = {entry_id: salt for entry_id, salt in session.execute(select(LogLeaf.entry_id, LogLeaf.salt))}
            session.execute(delete(LogLeaf))
            session.execute(delete(LogNode))
            frontier: list[bytes] = []
            for index, e in enumerate(session.scalars(select(LedgerEntry).order_by(LedgerEntry.id))):
                subject = chain.subject(EntryEvent(e.event), session.get_one(Silo, e.silo_id),
                                        None if e.charge_id is None else session.get_one(Charge, e.charge_id))
                salt = salts.get(e.id, "00" * 16)
                leaf = merkle.leaf_hash(transparency.leaf_record(e, subject=subject, salt=salt).encode())
                frontier, completed, _ = merkle.append(frontier, index, leaf)
                session.add(LogLeaf(idx=index, entry_id=e.id, salt=salt, leaf_hash=leaf.hex()))
                session.add_all(LogNode(level=w.bit_length() - 1, idx=start // w, hash=h.hex()) for start, w, h in completed)
            state = session.get_one(LogState, transparency.STATE_ID)
            state.size, state.frontier = index + 1, json.dumps([h.hex() for h in frontier])

    def edit_mechanism(self, charge_id: int, old: str, new: str) -> None:
        self.sql("UPDATE charges SET mechanism = replace(mechanism, :old, :new) WHERE id = :id", old=old, new=new, id=charge_id)

    def dispose(self) -> None:
        self.engine.dispose()


@pytest.fixture
def operator(url: str) -> Iterator[Operator]:
    op = Operator(url)
    yield op
    op.dispose()


def problems(out: Any) -> str:
    return "\n".join(out.problems)


# --- the tests ---------------------------------------------------------------------------------

def test_every_budget_answer_carries_a_receipt_that_checks_and_the_honest_log_passes_every_check(ledger: Ledger) -> None:
    a, b = ledger.a, ledger.b
    assert len(a.receipts) == 4 and len(b.receipts) == 6  # reserve, commit, release and search start each
    key = bytes.fromhex(PublicKey(**a.get()("/v1/log/public-key", None)).public_key)
    for promised, r in zip(a.promises + b.promises, a.receipts + b.receipts, strict=True):
        # The answer promises (signed) the leaf by a deadline, without waiting for the log; the silo
        # then finds it in the log: requests came one at a time, so in the tree just after it.
        assert promised.promise is not None and not promised.included
        assert promised.promise.deadline == promised.promise.timestamp + transparency.MERGE_DELAY_MS
        check_receipt(promised, key)
        check_receipt(r, key)
        assert r.tree_head is not None and r.log_index is not None and r.tree_head.tree_size == r.log_index + 1
    # 2 create entries + 10 budget entries, in the order the requests came.
    assert sorted(r.log_index or 0 for r in a.receipts + b.receipts) == list(range(2, 12))
    # A replayed reservation answers the first answer's promise, byte for byte, now with its
    # inclusion in the head its batch's sequencer signed.
    replay = Receipt(**ledger.client.post(f"/v1/silos/{ledger.ids['a']}/charges", headers=a.headers, json={
        "mechanism": STEP, "idempotency_key": "a0", "job_id": "j", "round": 2}).json()["receipt"])
    assert replay.promise == a.promises[0].promise and replay.log_index == a.receipts[0].log_index
    check_receipt(replay, key)
    # A promise altered in any field no longer verifies.
    forged = replay.model_copy(update={"promise": replay.promise.model_copy(update={"deadline": 2**40})})
    with pytest.raises(HeadError, match="does not carry a valid signature"):
        check_receipt(forged, key)
    # A silo reads other silos' leaf hashes, never their contents.
    leaves = a.get()("/v1/log/leaves", {"start": 0, "limit": 100})
    readable = [json.loads(leaf["record"])["entry"]["silo_id"] for leaf in leaves if leaf["record"] is not None]
    assert len(leaves) == 12 and readable == [ledger.ids["a"]] * 5  # a's create + its 4 entries
    assert ledger.client.get("/v1/log/proofs/inclusion", params={"index": b.receipts[0].log_index},
                             headers=a.headers).status_code == 403
    for party in (a, b):
        out = verify_receipts(party.get(), party.receipts)
        assert out.ok, problems(out)
    held = first_audit(ledger.auditor)
    assert SignedTreeHead(**held["head"]).tree_size == 12
    again_out = audit(ledger.auditor.get(), held)
    assert again_out.ok, problems(again_out)
    assert chain_ok(ledger.client)


def test_an_edited_mechanism_with_every_hash_recomputed_is_found_by_the_silo_and_by_the_auditor(
    ledger: Ledger, operator: Operator
) -> None:
    held = first_audit(ledger.auditor)
    # a0 now claims three times the noise: a third of its ε, and budget for more rounds.
    operator.edit_mechanism(ledger.ids["a0"], '"noise_multiplier":1.0', '"noise_multiplier":3.0')
    operator.rebuild()
    assert chain_ok(ledger.client)  # the per-silo chain alone is fooled
    before = ledger.a.receipts[0]
    out = verify_receipts(ledger.a.get(), ledger.a.receipts)
    assert not out.ok
    name = f"silo {ledger.ids['a']} entry {before.seq} (log index {before.log_index})"
    assert f"{name}: the entry now reads differently" in problems(out)
    # Same size, another root: the silo's newest head and today's are a fork, printed as evidence.
    assert "FORK: two signed heads of size 12" in problems(out)
    # And its oldest head that the rewrite touched (size 3, just after a0's reserve) is one too.
    assert "FORK: two signed heads of size 3 with different roots (the log before it was rewritten, and after)" in problems(out)
    assert len(out.evidence) == 2
    for evidence in out.evidence:
        assert is_fork(*(SignedTreeHead(**h) for h in evidence["heads"]), bytes.fromhex(evidence["public_key"]))
    # Silo b's own entries are untouched, and still its receipts show the log was rewritten.
    out_b = verify_receipts(ledger.b.get(), ledger.b.receipts)
    assert "FORK" in problems(out_b)
    assert "reads differently" not in problems(out_b)
    out_auditor = audit(ledger.auditor.get(), held)
    assert "FORK: two signed heads of size 12 with different roots" in problems(out_auditor)


def test_an_edited_epsilon_is_found_by_recomposing_the_charges_even_without_an_earlier_head(
    ledger: Ledger, operator: Operator
) -> None:
    held = first_audit(ledger.auditor)
    b2 = ledger.ids["b2"]
    # b2's reserve states half the ε it really brought b to; chain and log recomputed to match.
    operator.sql("UPDATE charges SET epsilon_spent_after = epsilon_spent_after / 2 WHERE id = :id", id=b2)
    operator.sql("UPDATE ledger_entries SET epsilon_spent = epsilon_spent / 2 WHERE charge_id = :id", id=b2)
    operator.rebuild(recompute_epsilon=False)
    assert chain_ok(ledger.client)
    fresh = audit(ledger.auditor.get(), None)  # an auditor that never saw the log before
    # b0 and b2 (b1 released), read through b's filter as the gate reads it (tests/gate_oracle.py).
    detail = ledger.client.get(f"/v1/silos/{ledger.ids['b']}", headers=ADMIN).json()
    expected = proven_epsilon(filter_of(detail), dpsgd_curve([(0.01, STEP["noise_multiplier"], STEP["steps"])] * 2), delta=1e-5)
    reserve_seq = 6
    line = next(p for p in fresh.problems if p.startswith(f"silo {ledger.ids['b']} entry {reserve_seq} "))
    assert f"states ε={expected / 2:.6g}, but its charges' mechanisms compose to ε={expected:.6g}" in line
    assert "FORK" in problems(audit(ledger.auditor.get(), held))
    out = verify_receipts(ledger.b.get(), ledger.b.receipts)
    assert "reads differently" in problems(out) and "FORK" in problems(out)


def test_the_last_entries_of_a_silo_deleted_with_the_running_sums_fixed_are_found(ledger: Ledger, operator: Operator) -> None:
    held = first_audit(ledger.auditor)
    b2 = ledger.ids["b2"]
    operator.sql("DELETE FROM ledger_entries WHERE charge_id = :id", id=b2)  # b2's reserve and commit: b's last two
    operator.sql("DELETE FROM charges WHERE id = :id", id=b2)
    operator.rebuild()
    assert chain_ok(ledger.client)
    out = verify_receipts(ledger.b.get(), ledger.b.receipts)
    # b's newest receipt came with the head of size 10 (its last entry); the cut log has 10 leaves again.
    assert "FORK: two signed heads of size 10 with different roots" in problems(out)
    for r in ledger.b.receipts[-2:]:  # their indices now hold silo a's entries, which silo b may not read
        name = f"silo {ledger.ids['b']} entry {r.seq} (log index {r.log_index})"
        assert f"{name}: the leaf at that index is no longer this silo's entry" in problems(out)
    assert "the log shrank from 12 to 10" in problems(audit(ledger.auditor.get(), held))
    # Silo a lost nothing, yet its entries moved: its receipts find the cut too.
    assert not verify_receipts(ledger.a.get(), ledger.a.receipts).ok


def test_a_charge_moved_between_silos_is_found(ledger: Ledger, operator: Operator) -> None:
    held = first_audit(ledger.auditor)
    a, b, a1 = ledger.ids["a"], ledger.ids["b"], ledger.ids["a1"]
    # a1 (a's reservation, seq 4) becomes b's 8th entry; a's search entry closes the gap.
    operator.sql("UPDATE charges SET silo_id = :b WHERE id = :id", b=b, id=a1)
    operator.sql("UPDATE ledger_entries SET silo_id = :b, seq = 8 WHERE charge_id = :id", b=b, id=a1)
    operator.sql("UPDATE ledger_entries SET seq = 4 WHERE silo_id = :a AND seq = 5", a=a)
    operator.rebuild()
    assert chain_ok(ledger.client)
    moved = next(r for r in ledger.a.receipts if r.seq == 4)
    out = verify_receipts(ledger.a.get(), ledger.a.receipts)
    name = f"silo {a} entry 4 (log index {moved.log_index})"
    assert f"{name}: the leaf at that index is no longer this silo's entry" in problems(out)
    assert "FORK" in problems(out)
    assert "FORK" in problems(audit(ledger.auditor.get(), held))


def test_two_logs_shown_to_two_parties_are_a_fork_that_the_cli_prints(
    tmp_path: Path, key: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real server and the `dpledger` command: the trainer's client keeps the receipts, the
    auditor's head file is written by `dpledger audit`. Then the operator serves a rewritten copy of
    the database (same key) to everyone, while the auditor saw the original."""
    honest, forked = tmp_path / "honest.db", tmp_path / "forked.db"
    monkeypatch.setenv("DPLEDGER_SIGNING_KEY_FILE", str(key))
    receipts, head_file = tmp_path / "receipts", tmp_path / "auditor-head.json"
    with running_server(database_url=f"sqlite:///{honest}", admin_key=ADMIN_KEY) as server:
        with LedgerClient(server, ADMIN_KEY, receipts=False) as admin:
            silo = admin.create_silo(name="clinic", epsilon=10.0, delta=1e-5, dataset_size=1000, horizon=STEP)
        auditor = httpx.post(f"{server}/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]
        with LedgerClient(server, silo.api_key, receipts=receipts) as client:
            charge_ids = [client.reserve(silo.id, mechanism=STEP, idempotency_key=f"r{i}").charge_id for i in range(3)]
            for charge_id in charge_ids:
                client.commit(charge_id)
        assert len(receipt_store.load(receipts).receipts) == 6  # one per answer, a completion merged with its promise
        # The sequencer signs a head per batch (0.1–1 s after a ring): the auditor reads the log once all 7 are in it.
        deadline = time.monotonic() + 30
        while httpx.get(f"{server}/v1/log/head", headers=ADMIN).json()["tree_size"] < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setenv("DPLEDGER_URL", server)
        monkeypatch.setenv("DPLEDGER_KEY", auditor)
        assert main(["audit", "--since", str(head_file)]) == 0
        assert "saved the head of size 7" in capsys.readouterr().out
        monkeypatch.setenv("DPLEDGER_KEY", silo.api_key)
        assert main(["verify", "--receipts", str(receipts)]) == 0
        assert main(["pubkey"]) == 0
        public = capsys.readouterr().out
        served_key = httpx.get(f"{server}/v1/log/public-key", headers=ADMIN).json()["public_key"]
        assert f"ed25519 {served_key}" in public
        assert main(["verify", "--receipts", str(receipts), "--public-key", served_key]) == 0  # pinned out of band
        wrong = Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        assert main(["verify", "--receipts", str(receipts), "--public-key", wrong.hex()]) == 1
        assert "the ledger's signing key changed" in capsys.readouterr().out
        overview = httpx.get(f"{server}/dashboard", cookies={"dpledger_dashboard_key": ADMIN_KEY}).text
        assert 'data-verified-size="7" data-still-extends="true"' in overview
    with sqlite3.connect(honest) as source, sqlite3.connect(forked) as target:
        source.backup(target)
    operator = Operator(f"sqlite:///{forked}")
    operator.edit_mechanism(charge_ids[0], '"noise_multiplier":1.0', '"noise_multiplier":4.0')
    operator.rebuild()
    operator.dispose()
    with running_server(database_url=f"sqlite:///{forked}", admin_key=ADMIN_KEY) as server:
        monkeypatch.setenv("DPLEDGER_URL", server)
        monkeypatch.setenv("DPLEDGER_KEY", auditor)
        assert main(["audit", "--since", str(head_file)]) == 1
        printed = capsys.readouterr().out
        assert "PROOF OF MISBEHAVIOUR" in printed and "FORK: two signed heads of size 7 with different roots" in printed
        evidence = json.loads(printed[printed.index("{"):printed.index("\n}\n") + 2])
        heads = [SignedTreeHead(**h) for h in evidence["heads"]]
        assert is_fork(heads[0], heads[1], bytes.fromhex(evidence["public_key"]))  # checkable by anyone with the key
        assert json.loads(head_file.read_text())["head"] == heads[0].model_dump()  # the evidence is kept, not replaced
        monkeypatch.setenv("DPLEDGER_KEY", silo.api_key)
        assert main(["verify", "--receipts", str(receipts)]) == 1
        assert "the entry now reads differently from what the ledger signed" in capsys.readouterr().out
        overview = httpx.get(f"{server}/dashboard", cookies={"dpledger_dashboard_key": ADMIN_KEY}).text
        assert 'data-still-extends="false"' in overview


def test_a_changed_signing_key_is_found_and_a_missing_one_refuses_production(
    ledger: Ledger, app_over: Any, url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    held = first_audit(ledger.auditor)
    # Restarted with another key (to sign a rewritten log, or the old one was lost): every party notices.
    other = app_over(url, write_key(tmp_path / "other.pem"))
    for party in (ledger.a, ledger.b):
        out = verify_receipts(Party(other, party.headers).get(), party.receipts)
        assert "the ledger's signing key changed" in problems(out)
    assert "the ledger's signing key changed" in problems(audit(Party(other, ledger.auditor.headers).get(), held))
    # With no key at all, development signs with an ephemeral one and says so; a restart is a new key.
    with caplog.at_level("WARNING", logger="dpledger.signer"):
        ephemeral = app_over(url, None)
    assert "ephemeral key" in caplog.text
    out = verify_receipts(Party(ephemeral, ledger.a.headers).get(), ledger.a.receipts)
    assert "the ledger's signing key changed" in problems(out)
    # Production refuses to start without one, or with one it cannot read.
    with pytest.raises(ValidationError, match="DPLEDGER_SIGNING_KEY_FILE"):
        Settings(database_url=url, admin_key=ADMIN_KEY, env="production")
    with pytest.raises(SigningKeyError, match="cannot read DPLEDGER_SIGNING_KEY_FILE"):
        create_app(Settings(database_url=url, admin_key=ADMIN_KEY, env="production", signing_key_file=tmp_path / "gone.pem"))
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(SigningKeyError, match="neither an Ed25519 PEM"):
        create_app(Settings(database_url=url, admin_key=ADMIN_KEY, signing_key_file=tmp_path / "bad.pem"))


def test_an_ordinary_edit_is_still_named_by_the_chain_check_and_by_the_log(ledger: Ledger, operator: Operator) -> None:
    a0 = ledger.ids["a0"]
    operator.edit_mechanism(a0, '"noise_multiplier":1.0', '"noise_multiplier":3.0')  # nothing recomputed
    report = ledger.client.get("/v1/audit/verify", headers=ADMIN).json()
    assert report["ok"] is False and a0 in report["bad_charge_ids"]
    out = verify_receipts(ledger.a.get(), ledger.a.receipts)
    assert "reads differently" in problems(out) and "FORK" not in problems(out)  # the log itself is intact
    fresh = audit(ledger.auditor.get(), None)
    assert any("the entry no longer matches its leaf (edited after it was logged)" in p for p in fresh.problems)
    # A deleted entry leaves its leaf behind (no foreign key holds it): named by both checks too.
    operator.sql("DELETE FROM ledger_entries WHERE silo_id = :b AND seq = 7", b=ledger.ids["b"])
    report = ledger.client.get("/v1/audit/verify", headers=ADMIN).json()
    assert report["ok"] is False and ledger.ids["b2"] in report["bad_charge_ids"]
    last = ledger.b.receipts[-1]
    assert f"log index {last.log_index}: no entry behind the leaf (it was deleted)" in problems(audit(ledger.auditor.get(), None))
    assert "the leaf at that index is no longer this silo's entry" in problems(verify_receipts(ledger.b.get(), ledger.b.receipts))


def test_the_migration_backfills_a_ledger_that_had_entries_before_the_log(url: str, operator: Operator, app_over: Any) -> None:
    """An existing ledger upgraded to this revision: its entries become the log's first leaves."""
    ledger = build(app_over())
    command.downgrade(alembic_config(url), "0003")
    restate_as_before_filters(url)
    command.upgrade(alembic_config(url), "head")
    out = audit(Party(app_over(), ledger.auditor.headers).get(), None)
    assert out.ok, problems(out)
    # 2 creates + 10 budget entries, every hash recomputed, then the filter entry that revision 0005
    # appends to each silo that held charges (the log is older than filters: 0003 → 0006 → 0004 → 0005).
    assert out.head is not None and out.head.tree_size == 14


def restate_as_before_filters(url: str) -> None:
    """The downgrade drops the filters, but the entries still state the ε the filters gave: restate
    them as a ledger of revision 0003 wrote them (dp-accounting's ε of the running sum), hashes too."""
    engine = create_engine(url)
    tables = MetaData()
    tables.reflect(engine, only=["silos", "charges", "ledger_entries"])
    silos_t, charges_t, entries_t = (tables.tables[n] for n in ("silos", "charges", "ledger_entries"))
    with engine.begin() as connection:
        for silo in connection.execute(select(silos_t)).mappings():
            charges = {c["id"]: SimpleNamespace(**c) for c in connection.execute(
                select(charges_t).where(charges_t.c.silo_id == silo["id"])).mappings()}
            live: dict[int, Any] = {}
            prev = chain.GENESIS
            for e in connection.execute(select(entries_t).where(entries_t.c.silo_id == silo["id"])
                                        .order_by(entries_t.c.seq)).mappings().all():
                entry = SimpleNamespace(**e)
                charge = charges.get(entry.charge_id)
                if charge is not None:
                    if entry.event == "reserve":
                        live[charge.id] = curve_from_json(charge.rdp)
                    elif entry.event == "release":
                        live.pop(charge.id, None)
                    total = sum(live.values(), RunningSum.empty(len(rdp.ORDERS)).curve())
                    entry.epsilon_spent = rdp.epsilon(total, delta=silo["delta"])[0]
                    if entry.event == "reserve":
                        charge.epsilon_spent_after = entry.epsilon_spent
                        connection.execute(charges_t.update().where(charges_t.c.id == charge.id)
                                           .values(epsilon_spent_after=entry.epsilon_spent))
                entry.prev_hash = prev
                subject = chain.silo_fields(SimpleNamespace(**silo)) if charge is None else chain.charge_fields(charge)
                entry.hash = chain.entry_hash(entry, subject=subject)  # type: ignore[arg-type]  # a namespace row
                connection.execute(entries_t.update().where(entries_t.c.id == entry.id).values(
                    epsilon_spent=entry.epsilon_spent, prev_hash=entry.prev_hash, hash=entry.hash))
                prev = entry.hash
            connection.execute(silos_t.update().where(silos_t.c.id == silo["id"]).values(chain_head=prev))
    engine.dispose()


def test_racing_approvals_of_several_silos_on_several_workers_build_one_log_that_audits(database_url: str) -> None:
    """Silos approve concurrently (on PostgreSQL, each under its own row lock, no lock shared by
    silos); the one elected sequencer among the workers makes one order of their leaves. No signing
    key is configured: `serve` hands its workers one development key, so every receipt names the
    same key."""
    workers = 4 if database_url.startswith("postgresql") else 2
    with running_server(database_url=database_url, admin_key=ADMIN_KEY, workers=workers) as server, \
            httpx.Client(base_url=server, timeout=60) as http:
        silos = [http.post("/v1/silos", headers=ADMIN, json={"name": f"s{i}", "epsilon": 100.0, "delta": 1e-5,
                                                               "dataset_size": 1000, "horizon": STEP}).json()
                 for i in range(4)]
        auditor = bearer(http.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"])

        def approve(i: int) -> dict[str, Any]:
            silo = silos[i % len(silos)]
            response = http.post(f"/v1/silos/{silo['id']}/charges", headers=bearer(silo['api_key']),
                                 json={"mechanism": STEP, "idempotency_key": f"k{i}"})
            assert response.status_code == 201, response.text
            return dict(response.json()["receipt"])

        with ThreadPoolExecutor(16) as pool:
            receipts = [Receipt(**r) for r in pool.map(approve, range(40))]

        def get(path: str, params: dict[str, Any] | None) -> Any:
            response = http.get(path, params=params, headers=auditor)
            assert response.status_code == 200, response.text
            return response.json()

        key = bytes.fromhex(get("/v1/log/public-key", None)["public_key"])
        with LedgerClient(server, auditor["Authorization"].removeprefix("Bearer "), receipts=False) as reader:
            included = {r.leaf_hash: reader.included(r) for r in receipts}  # each waits at most to its deadline
        out = audit(get, None)
        assert out.ok, problems(out)
        assert out.head is not None and out.head.tree_size == 4 + 40
        assert sorted(p.log_index for p in included.values() if p is not None) == list(range(4, 44))
        for r in receipts:
            check_receipt(r, key)
            r = r.model_copy(update={"log_index": included[r.leaf_hash].log_index})  # type: ignore[union-attr]  # all found above
            assert r.log_index is not None
            merkle.verify_inclusion(
                index=r.log_index, size=out.head.tree_size, leaf=bytes.fromhex(r.leaf_hash),
                path=[bytes.fromhex(p) for p in get("/v1/log/proofs/inclusion", {"index": r.log_index})["path"]],
                root_hash=bytes.fromhex(out.head.root_hash),
            )


def test_the_commands_name_a_missing_receipt_folder_or_a_foreign_head_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--receipts", str(tmp_path / "none")]) == 2
    assert f"no receipts at {tmp_path / 'none'}" in capsys.readouterr().err
    (tmp_path / "head.json").write_text('{"head": {"tree_size": -1}}')
    assert main(["audit", "--since", str(tmp_path / "head.json")]) == 2
    assert "is not a head file that `dpledger audit` wrote" in capsys.readouterr().err
