"""The log's sequencer and a kill: approvals answered while their leaves wait for the sequencer, then
the whole server SIGKILLed, then restarted. Nothing approved may be missing from the log: the next
sequencer finds the pending leaves, every promise is kept, and the log audits.

The first server's sequencer looks for work once a minute (DPLEDGER_LOG_SEQUENCE_INTERVAL_MS), so
the kill lands between the leaves' writes and their sequencing for certain, not by luck of timing;
the restarted one runs at the default 100 ms. (tests/reliability/test_crash.py kills a server under
load at random moments, inside batches too, and checks the same.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from dpledger.audit.transparency import audit, verify_receipts
from dpledger.harness import ServerProcess
from dpledger.service.ledger.signer import ephemeral_seed
from dpledger.wire.client import LedgerClient
from dpledger.wire.receipts import Receipt
from tests.conftest import ADMIN, ADMIN_KEY, bearer

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.0, "steps": 1}
CHARGES = 12


def _pending(url: str) -> int:
    engine = create_engine(url)
    with engine.connect() as connection:
        count = int(connection.execute(text("SELECT count(*) FROM log_pending")).scalar_one())
    engine.dispose()
    return count


def test_a_kill_before_sequencing_loses_no_leaf_and_the_next_sequencer_keeps_every_promise(
    ledger_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPLEDGER_SIGNING_KEY", ephemeral_seed())  # one key across the restart
    monkeypatch.setenv("DPLEDGER_LOG_SEQUENCE_INTERVAL_MS", "60000")
    server = ServerProcess(database_url=ledger_url, admin_key=ADMIN_KEY, workers=2)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            silo = http.post("/v1/silos", headers=ADMIN, json={"name": "kept", "epsilon": 50.0, "delta": 1e-5,
                                                                 "dataset_size": 1000, "horizon": STEP}).json()
            receipts = []
            for i in range(CHARGES):
                answer = http.post(f"/v1/silos/{silo['id']}/charges", headers=bearer(silo["api_key"]),
                                   json={"mechanism": STEP, "idempotency_key": f"k{i}"})
                assert answer.status_code == 201, answer.text
                receipts.append(Receipt(**answer.json()["receipt"]))
        server.kill()
        # Every approval answered, none of them in the log: the kill came before their batch.
        assert all(r.promise is not None and not r.included for r in receipts)
        assert _pending(ledger_url) >= CHARGES

        monkeypatch.delenv("DPLEDGER_LOG_SEQUENCE_INTERVAL_MS")
        server.start()
        with LedgerClient(server.url, silo["api_key"], receipts=False) as client:
            completed = [client.complete(r) for r in receipts]  # waits for the new sequencer, within each deadline
        assert all(c is not None for c in completed)
        assert sorted(c.log_index for c in completed if c is not None and c.log_index is not None) == \
            list(range(1, 1 + CHARGES))  # the create entry is index 0, then the charges in order
        assert _pending(ledger_url) == 0

        with httpx.Client(base_url=server.url, timeout=60) as http:
            auditor = bearer(http.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"])

            def get(path: str, params: dict[str, object] | None, headers: dict[str, str] = auditor) -> object:
                response = http.get(path, params=params, headers=headers)
                assert response.status_code == 200, response.text
                return response.json()

            out = verify_receipts(lambda p, q: get(p, q, bearer(silo["api_key"])), receipts)
            assert out.ok, out.problems
            whole = audit(get, None)
            assert whole.ok, whole.problems
            assert whole.head is not None and whole.head.tree_size == 1 + CHARGES
    finally:
        server.stop()
