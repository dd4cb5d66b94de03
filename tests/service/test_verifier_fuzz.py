"""Issue 41 item 4: the verifiers never crash, whatever a hostile ledger serves. An honest ledger's log
is captured once (in-process); then mutated records (a field deleted, retyped, made huge or absurd;
the JSON texts inside a subject too), with their leaves and the signed head recomputed so that each is
"signed", are fed to the pure checking functions: a silo's replay (`compose_silo`), the auditor's
`audit` and a silo's `verify_receipts` over a stub that serves them. Each must return its findings,
never raise; and a mutation of what an entry states is a finding. Seeded, a few seconds."""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dpledger.audit.outcome import Outcome
from dpledger.audit.recompose import compose_silo
from dpledger.audit.transparency import RefusedError, audit, verify_receipts
from dpledger.service.api.app import create_app
from dpledger.service.ledger.signer import TreeHeadSigner, parse_private_key
from dpledger.service.settings import Settings
from dpledger.wire import merkle
from dpledger.wire.receipts import Receipt, record_leaf_hash
from tests.conftest import ADMIN, ADMIN_KEY, TEST_HORIZON, bearer
from tests.service.test_transparency import SEARCH, STEP, write_key

ODD: list[Any] = [None, -1, 0, 1e308, -1e308, "x", "", [], {}, True, 2**70, "NaN", [1, 0, 0], {"a": 1}]


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("fuzz")
    from dpledger.service.store.db import migrate

    url = f"sqlite:///{folder}/ledger.db"
    migrate(url)
    key_file = write_key(folder / "key.pem")
    app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY, signing_key_file=key_file, log_sequence_interval_ms=10))
    http = TestClient(app)
    created = http.post("/v1/silos", headers=ADMIN, json={"name": "f", "epsilon": 10.0, "delta": 1e-5,
                                                          "dataset_size": 1000, "horizon": TEST_HORIZON}).json()
    silo, headers = created["id"], bearer(created["api_key"])
    receipts = []
    for i in range(3):
        answer = http.post(f"/v1/silos/{silo}/charges", headers=headers, json={"mechanism": STEP, "idempotency_key": f"k{i}"})
        receipts.append(answer.json()["receipt"])
        settled = http.post(f"/v1/charges/{answer.json()['charge_id']}/{'release' if i == 1 else 'commit'}", headers=headers)
        receipts.append(settled.json()["receipt"])
    receipts.append(http.post(f"/v1/silos/{silo}/searches", headers=headers, json={**SEARCH, "idempotency_key": "s"}
                              ).json()["receipt"])
    while http.get("/v1/log/head", headers=ADMIN).json()["tree_size"] < 8:
        time.sleep(0.02)
    leaves = http.get("/v1/log/leaves", headers=ADMIN, params={"limit": 100}).json()
    detail = http.get(f"/v1/silos/{silo}", headers=ADMIN).json()
    app.state.engine.dispose()
    return {"silo": silo, "leaves": leaves, "detail": detail, "key_file": key_file, "receipts": receipts}


def mutate(record: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """One field of the entry or the subject deleted or given an odd value; a JSON text in the
    subject (mechanism, rdp, filter, plan) parsed, mutated inside, written back."""
    record = copy.deepcopy(record)
    part = record[rng.choice(["entry", "subject"])]
    if not part:
        return record
    name = rng.choice(sorted(part))
    value = part[name]
    if isinstance(value, str) and value[:1] in "[{":
        try:
            inner = json.loads(value)
        except ValueError:
            inner = None
        if isinstance(inner, dict) and inner:
            inner[rng.choice(sorted(inner))] = rng.choice(ODD)
            part[name] = json.dumps(inner)
            return record
        if isinstance(inner, list) and inner:
            inner[rng.randrange(len(inner))] = rng.choice(ODD)
            part[name] = json.dumps(inner) if rng.random() < 0.8 else json.dumps(inner[: len(inner) // 2])
            return record
    if rng.random() < 0.2:
        del part[name]
    else:
        part[name] = rng.choice(ODD)
    return record


class Stub:
    """Serves a log of the given records as a ledger would, with its head signed by the log's key."""

    def __init__(self, captured: dict[str, Any], records: list[str | None]) -> None:
        self.signer = TreeHeadSigner(parse_private_key(Path(captured["key_file"]).read_bytes()))
        self.detail, self.silo = captured["detail"], captured["silo"]
        self.leaves = [{"log_index": i, "record": r, "leaf_hash": record_leaf_hash(r) if r is not None
                        else captured["leaves"][i]["leaf_hash"]} for i, r in enumerate(records)]
        hashes = [bytes.fromhex(leaf["leaf_hash"]) for leaf in self.leaves]
        self.head = self.signer.sign(tree_size=len(hashes), root_hash=merkle.root(hashes).hex())
        self.hashes = hashes

    def subtree(self, start: int, width: int) -> bytes:
        return merkle.root(self.hashes[start:start + width])

    def get(self, path: str, params: dict[str, Any] | None) -> Any:
        params = params or {}
        if path == "/v1/log/public-key":
            return self.signer.public().model_dump()
        if path == "/v1/log/head":
            return self.head.model_dump()
        if path == "/v1/log/leaves":
            start = params.get("start", 0)
            chosen = [leaf for leaf in self.leaves if leaf["log_index"] >= start]
            if params.get("silo_id") is not None:
                chosen = [leaf for leaf in chosen if leaf["record"] is not None and _silo(leaf["record"]) == params["silo_id"]]
            return chosen[: params.get("limit", 1000)]
        if path == "/v1/log/proofs":
            size = params["size"]
            inclusion = [int(i) for i in params["inclusion"].split(",") if i]
            firsts = [int(f) for f in params["consistency"].split(",") if f]
            return {"tree_size": size,
                    "inclusion": [{"log_index": i, "tree_size": size, "leaf_hash": self.hashes[i].hex(),
                                   "path": [p.hex() for p in merkle.inclusion_proof(i, size, self.subtree)]} for i in inclusion],
                    "consistency": [{"first": f, "second": size,
                                     "path": [p.hex() for p in merkle.consistency_proof(f, size, self.subtree)]} for f in firsts]}
        if path == f"/v1/silos/{self.silo}":
            return self.detail
        if path == "/v1/silos":
            return [self.detail]
        raise RefusedError(f"HTTP 404 from {path}")


def _silo(record: str) -> Any:
    try:
        return json.loads(record)["entry"]["silo_id"]
    except (ValueError, KeyError, TypeError):
        return None


def test_mutated_records_and_histories_are_findings_never_a_crash(captured: dict[str, Any]) -> None:
    rng = random.Random(41)
    honest = [json.loads(leaf["record"]) for leaf in captured["leaves"]]
    silo = captured["silo"]
    out = Outcome()
    compose_silo(silo, honest, out)
    assert out.ok, out.problems
    stated = 0
    for _ in range(300):  # the silo's replay alone: the one that reads the accounting
        records = list(honest)
        for _ in range(rng.choice([1, 1, 2, 3])):
            i = rng.randrange(len(records))
            records[i] = mutate(records[i], rng)
        out = Outcome()
        compose_silo(silo, records, out)  # must not raise
        if records != honest and any(r["entry"].get("epsilon_spent") != h["entry"]["epsilon_spent"]
                                     for r, h in zip(records, honest, strict=True)):
            stated += 1
            assert not out.ok, [r["entry"] for r, h in zip(records, honest, strict=True) if r != h]
    assert stated > 0
    receipts = [Receipt(**r) for r in captured["receipts"]]
    for _ in range(60):  # the auditor's and the silo's checks, over a stub serving a mutated, re-signed log
        texts: list[str | None] = [json.dumps(r, sort_keys=True) for r in honest]
        i = rng.randrange(len(texts))
        choice = rng.random()
        texts[i] = None if choice < 0.1 else ("{not json" if choice < 0.2 else json.dumps(mutate(honest[i], rng)))
        stub = Stub(captured, texts)
        assert isinstance(audit(stub.get, None), Outcome)
        # The silo's receipts no longer match the re-signed log (its clock past every deadline: no wait).
        assert not verify_receipts(stub.get, receipts, clock=lambda: 2.0**40).ok
