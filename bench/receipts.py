"""What a receipt costs, part by part, beside what it is added to (the approval around it).

* Ed25519: signing one tree head and verifying it (cryptography);
* the log's append (the leaf record, its hash, the frontier update) and the new root from the
  frontier, at log sizes 10 and 1,000,000 (a root is O(log n) hashes, never a pass over leaves);
* a proof read from the database (an earlier entry's receipt, or GET /v1/log/proofs/…) at a log of
  `--entries` leaves on SQLite: two queries for O(log n) rows;
* the bytes a receipt adds to an approval's answer (JSON, as sent).

The approval's own latency under load is bench/approvals.py's (run it before and after). Prints a
table, then one JSON line.

    python bench/receipts.py            # ~20 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from sqlalchemy import select

from dpledger.service.api.app import create_app
from dpledger.service.ledger import transparency
from dpledger.service.ledger.db import Database, migrate
from dpledger.service.ledger.models import LedgerEntry, LogLeaf
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.settings import Settings
from dpledger.wire import merkle
from dpledger.wire.receipts import verify_head

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
    args = parser.parse_args()
    figures: dict[str, float] = {}

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
        print(f"{name:28} {value:.4g}")
    print(json.dumps(figures))


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
