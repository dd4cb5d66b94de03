"""What a receipt costs, part by part, beside what it is added to (the approval around it).

* Ed25519: signing one tree head and verifying it (cryptography);
* the log's append (the leaf record, its hash, the frontier update) and the new root from the
  frontier, at log sizes 10 and 1,000,000 (a root is O(log n) hashes, never a pass over leaves);
* a proof read from the database (an earlier entry's receipt, or GET /v1/log/proofs/…) at a log of
  `--entries` leaves on SQLite: two queries for O(log n) rows;
* the bytes a receipt adds to an approval's answer (JSON, as sent).

The approval's own latency under load is bench/approvals.py's (run it before and after).

And what checking costs, against a real server (`dpledger serve` in a child process) on a SQLite log
of `--audit-entries` entries (default 100,000: silos of DP-SGD charges, each reserved and committed,
seeded through the ledger's own append), with the commands' own code over HTTP:

* `sequence_seed_s`: the server's sequencer moving the seed's pending leaves into the log (the
  bulk seed's catch-up, timed apart so that the checks below are not);
* `verify_receipts_s`: a silo's `dpledger verify --receipts` over `--receipts` receipts (default 100;
  goal ≤ 2 s): every distinct head, every entry of the silo, ε recomposed;
* `audit_s`: an auditor's first `dpledger audit` of the whole log (goal ≤ 10 s): every leaf against
  the root, every silo's ε recomposed from its mechanisms.

Prints a table, then one JSON line.

    python bench/receipts.py                              # audits a 100,000-entry log
    python bench/receipts.py --audit-entries 10000        # ~30 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _seeding
import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from sqlalchemy import create_engine, select

from dpledger.audit import transparency as log_check
from dpledger.harness import running_server
from dpledger.service.api.app import create_app
from dpledger.service.ledger import silos, transparency
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.settings import Settings
from dpledger.service.store.db import Database, migrate
from dpledger.service.store.models import LedgerEntry, LogLeaf
from dpledger.wire import merkle
from dpledger.wire.mechanisms import Mechanism
from dpledger.wire.receipts import Receipt, verify_head

from _harness import wait_sequenced

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
STEP = {"type": "dpsgd", "batch_size": 256, "noise_multiplier": 1.1, "steps": 1}


def per_call_us(fn: Callable[[], Any], *, repeat: int) -> float:
    """Median over 5 runs of the mean µs per call."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(runs)


def frontier_of(size: int) -> list[bytes]:
    # The frontier's shape is all that matters for timing: one hash per set bit of the size.
    return [merkle.leaf_hash(bytes([i])) for i in range(bin(size).count("1"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=20_000, help="log size for the database proofs (default 20000)")
    parser.add_argument("--audit-entries", type=int, default=100_000, help="log size for the audit (default 100000)")
    parser.add_argument("--receipts", type=int, default=100, help="receipts a silo verifies (default 100)")
    args = parser.parse_args()
    figures: dict[str, float] = {}
    verification(figures, entries=args.audit_entries, receipts=args.receipts)

    signer = TreeHeadSigner(Ed25519PrivateKey.generate())
    root = merkle.leaf_hash(b"root").hex()
    head = signer.sign(tree_size=1, root_hash=root)
    figures["sign_us"] = per_call_us(lambda: signer.sign(tree_size=12345, root_hash=root), repeat=2000)
    figures["verify_us"] = per_call_us(lambda: verify_head(head, signer.public_key), repeat=2000)
    record = "x" * 2600  # a dpsgd charge's leaf record is ~2.6 kB (its RDP vector at 150 orders)
    for size in (10, 1_000_000):
        frontier = frontier_of(size)
        figures[f"append_us_at_{size}"] = per_call_us(
            lambda f=frontier, n=size: merkle.append(f, n, merkle.leaf_hash(record.encode())), repeat=5000)
        figures[f"root_us_at_{size}"] = per_call_us(lambda f=frontier: merkle.frontier_root(f), repeat=5000)

    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/bench.db"
        migrate(url)
        app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY))
        client = TestClient(app)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        silo = client.post("/v1/silos", headers=admin, json={"name": "s", "epsilon": 1e4, "delta": 1e-5,
                                                              "dataset_size": 60_000}).json()
        headers = {"Authorization": f"Bearer {silo['api_key']}"}
        answer = client.post(f"/v1/silos/{silo['id']}/charges", headers=headers,
                             json={"mechanism": STEP, "idempotency_key": "first"}).content
        body = json.loads(answer)
        figures["answer_bytes"] = len(answer)
        figures["receipt_bytes"] = len(answer) - len(json.dumps({k: v for k, v in body.items() if k != "receipt"},
                                                                separators=(",", ":")))
        # Grow the log to --entries leaves with the ledger's own append (create entries are the cheapest).
        db = Database.connect(url)
        with db.write() as session:
            template = session.scalars(select(LedgerEntry).order_by(LedgerEntry.id).limit(1)).one()
            subject = {"bench": True}
            for _ in range(args.entries - 2):
                _append_copy(session, template, subject)
        with db.read() as session:
            size, _ = transparency.size_and_root(session)
            middle = session.scalars(select(LogLeaf).where(LogLeaf.idx == size // 3)).one()
            figures["log_size"] = size
            figures["inclusion_proof_ms"] = per_call_us(
                lambda: transparency.inclusion(session, middle.idx, size), repeat=50) / 1e3
            figures["consistency_proof_ms"] = per_call_us(
                lambda: transparency.consistency(session, size // 3, size), repeat=50) / 1e3
            figures["root_at_past_size_ms"] = per_call_us(lambda: transparency.root_at(session, size // 3), repeat=50) / 1e3
        app.state.engine.dispose()

    print(f"{'figure':28} value")
    for name, value in figures.items():
        goal = f"  (goal ≤ {GOALS[name]:g} s: {'met' if value <= GOALS[name] else 'MISSED'})" if name in GOALS else ""
        print(f"{name:28} {value:.4g}{goal}")
    print(json.dumps(figures))


SILO_CHARGES = 5_000  # per seeded silo: two entries each (reserve, commit)
GOALS = {"verify_receipts_s": 2.0, "audit_s": 10.0}


def verification(figures: dict[str, float], *, entries: int, receipts: int) -> None:
    """Times `verify --receipts` and `audit` against a real server on a log of `entries` entries."""
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/verify.db"
        migrate(url)
        key_file = Path(folder) / "log-key.pem"
        key_file.write_bytes(Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        os.environ["DPLEDGER_SIGNING_KEY_FILE"] = str(key_file)
        print(_seeding.check(commit=True), file=sys.stderr)
        start = time.perf_counter()
        db = Database.connect(url)
        remaining, number = entries - (receipts + 1), 0
        while remaining > 0:
            charges_here = min(SILO_CHARGES, max(1, remaining // 2))
            _seed_silo(db, f"seeded-{number}", charges_here)
            remaining -= 2 * charges_here + 1
            number += 1
        db.engine.dispose()
        figures["seed_s"] = time.perf_counter() - start
        with running_server(database_url=url, admin_key=ADMIN_KEY) as server, httpx.Client(base_url=server, timeout=120) as http:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            silo = http.post("/v1/silos", headers=admin, json={"name": "checked", "epsilon": 1e4, "delta": 1e-5,
                                                                "dataset_size": 1000}).json()
            headers = {"Authorization": f"Bearer {silo['api_key']}"}
            held = []
            for i in range(receipts // 2):
                answer = http.post(f"/v1/silos/{silo['id']}/charges", headers=headers,
                                   json={"mechanism": STEP_SMALL, "idempotency_key": f"r{i}"}).json()
                held.append(Receipt(**answer["receipt"]))
                held.append(Receipt(**http.post(f"/v1/charges/{answer['charge_id']}/commit", headers=headers).json()["receipt"]))
            auditor = http.post("/v1/keys", headers=admin, json={"role": "auditor"}).json()["api_key"]
            # The seed left every leaf pending: the server's sequencer moves them first (~60,000 a second),
            # and a receipt's promise waits behind them. Timed apart: that catch-up is the bulk seed's, not
            # a check's (a served approval's leaf is sequenced within 100 ms).
            start = time.perf_counter()
            engine = create_engine(url)
            wait_sequenced(engine, timeout=1800)
            engine.dispose()
            figures["sequence_seed_s"] = time.perf_counter() - start
            os.environ["DPLEDGER_URL"] = server
            os.environ["DPLEDGER_KEY"] = silo["api_key"]
            start = time.perf_counter()
            out = log_check.verify_receipts(log_check.http_get, held)
            figures["verify_receipts_s"] = time.perf_counter() - start
            assert out.ok, out.problems
            os.environ["DPLEDGER_KEY"] = auditor
            start = time.perf_counter()
            out = log_check.audit(log_check.http_get, None)
            figures["audit_s"] = time.perf_counter() - start
            assert out.ok, out.problems[:5]
            assert out.head is not None
            figures["audit_entries"] = out.head.tree_size
            figures["verified_receipts"] = len(held)
        for name in ("DPLEDGER_SIGNING_KEY_FILE", "DPLEDGER_URL", "DPLEDGER_KEY"):  # the key file is gone with the folder
            os.environ.pop(name, None)


STEP_SMALL = {"type": "dpsgd", "batch_size": 16, "noise_multiplier": 1.1, "steps": 10}
STEP_MECHANISM = TypeAdapter(Mechanism).validate_python(STEP_SMALL)


def _seed_silo(db: Database, name: str, count: int) -> None:
    """A silo with `count` DP-SGD charges, each reserved then committed, seeded in bulk as a loop of
    reserve and commit would write them (bench/_seeding.py, checked at start): the audit then
    recomposes each entry's ε, so a seeding that differs from the ledger's would fail it."""
    silo, _ = silos.register(db, name=name, epsilon=1e4, delta=1e-5, dataset_size=1000)
    _seeding.seed(db, silo.id, count, mechanism=lambda _i: STEP_MECHANISM, commit=True)


def _append_copy(session: Any, template: LedgerEntry, subject: dict[str, Any]) -> None:
    """A new entry row like `template` (another seq), appended to the log as the ledger does."""
    state_size, _ = transparency.size_and_root(session)
    entry = LedgerEntry(silo_id=template.silo_id, seq=100_000 + state_size, event=template.event, charge_id=None,
                        epsilon_spent=0.0, created_at=template.created_at, prev_hash=template.prev_hash, hash=template.hash)
    session.add(entry)
    session.flush()
    transparency.append(session, entry, subject=subject)


if __name__ == "__main__":
    main()
