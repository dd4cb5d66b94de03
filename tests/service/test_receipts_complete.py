"""Issue 41 items 2 and 3: receipts that complete themselves, and proofs from signed data alone.

Two silos (two sites, two receipts folders) train through the trainer's client, which keeps each
answer's promise and completes it, once the sequencer logged it, with its index, a signed head and
the path to it. Then the operator, holding the database and the signing key, rewrites: two silos'
entries swapped in the log and every node and stored head recomputed and signed again. Each silo,
alone, finds it and prints a proof that tests/wire/proof_checker.py (written from RFC 9162 and the
byte layouts, with no dpledger code) accepts. A naive σ×4 edit of a committed charge is found without
a proof built from the edited records; a log restored from a backup and grown again breaks a promise,
and its proof lists the signed head's every leaf.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from dpledger.audit import held
from dpledger.audit.outcome import Get, Outcome
from dpledger.audit.transparency import RefusedError
from dpledger.service.api.app import create_app
from dpledger.service.ledger import transparency
from dpledger.service.ledger.signer import TreeHeadSigner, parse_private_key
from dpledger.service.settings import Settings
from dpledger.wire import merkle, receipt_store
from dpledger.wire.client import LedgerClient
from dpledger.wire.errors import Rejected
from tests.conftest import ADMIN, ADMIN_KEY, TEST_HORIZON
from tests.service.test_transparency import STEP, write_key
from tests.wire.proof_checker import check_proof

TRAINING_S = 0.15  # a round's training: the sequencer (10 ms here, ≤ 100 ms with its gathering) logs its reserve meanwhile


@dataclass
class Site:
    silo_id: int
    key: str
    folder: Path


@dataclass
class World:
    url: str
    http: TestClient
    key_file: Path
    sites: dict[str, Site]

    def get(self, key: str) -> Get:
        def get(path: str, params: dict[str, object] | None) -> object:
            response = self.http.get(path, params=params, headers={"Authorization": f"Bearer {key}"})
            if response.status_code >= 400:
                raise RefusedError(f"HTTP {response.status_code} from {path}: {response.text}")
            return response.json()

        return get

    def train(self, name: str, rounds: int, label: str) -> None:
        site = self.sites[name]
        with LedgerClient("http://testserver", site.key, http=self.http, receipts=site.folder) as client:
            for r in range(rounds):
                charge = client.reserve(site.silo_id, mechanism=STEP, idempotency_key=f"{label}{r}", job_id=label, round=r)
                time.sleep(TRAINING_S)
                client.commit(charge.charge_id)

    def check(self, name: str) -> Outcome:
        site = self.sites[name]
        return held.check(self.get(site.key), site.folder, public_key=None, silo=None, holder=site.key)


@pytest.fixture
def world(url: str, tmp_path: Path) -> Iterator[World]:
    yield from make_world(url, tmp_path)


@pytest.fixture
def any_world(database_url: str, tmp_path: Path) -> Iterator[World]:
    """On SQLite, and on PostgreSQL where DPLEDGER_TEST_POSTGRES_URL is set."""
    yield from make_world(database_url, tmp_path)


def make_world(url: str, tmp_path: Path) -> Iterator[World]:
    key_file = write_key(tmp_path / "log.pem")
    app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY, signing_key_file=key_file, log_sequence_interval_ms=10))
    http = TestClient(app)
    sites = {}
    for name in ("a", "b"):
        created = http.post("/v1/silos", headers=ADMIN, json={"name": name, "epsilon": 10.0, "delta": 1e-5,
                                                              "dataset_size": 1000, "horizon": TEST_HORIZON}).json()
        sites[name] = Site(created["id"], created["api_key"], tmp_path / f"receipts-{name}")
    yield World(url, http, key_file, sites)
    app.state.engine.dispose()


def rebuild_log(url: str, key_file: Path, order: list[int]) -> None:
    """The operator's rewrite: the log's leaves put in `order` (old index per new index), every stored
    subtree, the frontier and every stored head recomputed, each head signed again with the log's key."""
    signer = TreeHeadSigner(parse_private_key(key_file.read_bytes()))
    engine = create_engine(url)
    with engine.begin() as connection:
        rows = connection.execute(text("SELECT idx, entry_id, salt, leaf_hash, promised_by FROM log_leaves ORDER BY idx")).all()
        moved = [rows[i] for i in order]
        connection.execute(text("DELETE FROM log_leaves"))
        connection.execute(text("DELETE FROM log_nodes"))
        frontier: list[bytes] = []
        for index, row in enumerate(moved):
            connection.execute(text("INSERT INTO log_leaves (idx, entry_id, salt, leaf_hash, promised_by) "
                                    "VALUES (:i, :e, :s, :h, :p)"),
                               {"i": index, "e": row.entry_id, "s": row.salt, "h": row.leaf_hash, "p": row.promised_by})
            frontier, completed, _ = merkle.append(frontier, index, bytes.fromhex(row.leaf_hash))
            for start, width, digest in completed:
                connection.execute(text("INSERT INTO log_nodes (level, idx, hash) VALUES (:l, :i, :h)"),
                                   {"l": width.bit_length() - 1, "i": start // width, "h": digest.hex()})
        connection.execute(text("UPDATE log_state SET frontier = :f"), {"f": json.dumps([h.hex() for h in frontier])})
        leaves = [bytes.fromhex(row.leaf_hash) for row in moved]
        for (size,) in connection.execute(text("SELECT tree_size FROM log_heads")).all():
            head = signer.sign(tree_size=size, root_hash=merkle.root(leaves[:size]).hex())
            connection.execute(text("UPDATE log_heads SET root_hash = :r, timestamp = :t, signature = :s "
                                    "WHERE tree_size = :n"),
                               {"r": head.root_hash, "t": head.timestamp, "s": head.signature, "n": size})
    engine.dispose()


def indices_of(url: str, silo_id: int) -> list[int]:
    engine = create_engine(url)
    with engine.connect() as connection:
        found = [i for (i,) in connection.execute(text(
            "SELECT l.idx FROM log_leaves l JOIN ledger_entries e ON e.id = l.entry_id WHERE e.silo_id = :s ORDER BY l.idx"),
            {"s": silo_id})]
    engine.dispose()
    return found


def test_two_silos_entries_swapped_in_a_rebuilt_and_resigned_log_are_found_by_each_silo_alone(any_world: World) -> None:
    world = any_world
    world.train("a", 2, "a")
    world.train("b", 2, "b")
    world.train("a", 1, "a-late")
    for name in ("a", "b"):  # honest: both quiet, and what they hold is complete
        out = world.check(name)
        assert out.ok, out.problems
        kept = receipt_store.load(world.sites[name].folder)
        assert kept.receipts and all(r.included for r in kept.receipts)
        assert len({r.tree_head.tree_size for r in kept.receipts if r.tree_head is not None}) >= 1
    a_first = indices_of(world.url, world.sites["a"].silo_id)[1]  # a's first reserve (index 0 is its create)
    b_first = indices_of(world.url, world.sites["b"].silo_id)[1]
    size = world.http.get("/v1/log/head", headers=ADMIN).json()["tree_size"]
    order = list(range(size))
    order[a_first], order[b_first] = order[b_first], order[a_first]
    rebuild_log(world.url, world.key_file, order)
    # The rewritten log is whole: an auditor with no earlier head, and the chain check, see nothing.
    assert world.http.get("/v1/audit/verify", headers=ADMIN).json()["ok"]
    for name in ("a", "b"):
        out = world.check(name)
        assert not out.ok
        assert any(p.startswith("FORK: two signed heads of size") for p in out.problems), out.problems
        kinds = [check_proof(evidence) for evidence in out.evidence]
        assert "fork" in kinds, out.evidence
        # and nothing new was kept from the rewritten log
        heads = {json.loads(p.read_text())["head"]["root_hash"] for p in world.sites[name].folder.rglob("head.json")}
        assert world.http.get("/v1/log/head", headers=ADMIN).json()["root_hash"] not in heads


def test_a_naive_edit_of_a_committed_charge_is_found_and_no_proof_rests_on_the_edited_records(any_world: World) -> None:
    world = any_world
    world.train("b", 3, "b")
    assert world.check("b").ok
    engine = create_engine(world.url)
    with engine.begin() as connection:  # σ × 4 on b's first charge, nothing recomputed
        charge = connection.execute(text("SELECT min(id) FROM charges WHERE silo_id = :s"),
                                    {"s": world.sites["b"].silo_id}).scalar_one()
        connection.execute(text("UPDATE charges SET mechanism = replace(mechanism, :old, :new) WHERE id = :id"),
                           {"old": '"noise_multiplier":1.0', "new": '"noise_multiplier":4.0', "id": charge})
    engine.dispose()
    out = world.check("b")
    said = "\n".join(out.problems)
    assert "the entry now reads differently from what the ledger signed" in said
    assert "states ε=" not in said and "compose to" not in said  # nothing recomposed from an unsigned record
    assert any("recomposed from its signed entries before log index" in n for n in out.notes)
    for evidence in out.evidence:
        check_proof(evidence)


def test_a_lowered_running_sum_is_refused_before_any_approval_rests_on_it(world: World) -> None:
    """The running sum is recomputed from the silo's chain at every load (seals.py): an operator who
    lowers it gets a 409 naming the record, and so does the silo's own check."""
    world.train("b", 2, "b")
    engine = create_engine(world.url)
    with engine.begin() as connection:
        from dpledger.service.accounting import rdp
        from dpledger.service.accounting.running_sum import RunningSum

        connection.execute(text("UPDATE silos SET rdp_spent = :z WHERE id = :s"),
                           {"z": RunningSum.empty(len(rdp.ORDERS)).to_json(), "s": world.sites["b"].silo_id})
    engine.dispose()
    with pytest.raises(Rejected) as refused:
        world.train("b", 1, "b-after")
    assert refused.value.status_code == 409, refused.value.body
    assert refused.value.body["tampered"]["table"] == "silos", refused.value.body
    assert "rdp_spent" in refused.value.body["detail"]
    out = world.check("b")  # the silo's own check hears the same freeze, and finds nothing else wrong
    assert len(out.problems) == 1 and "refuses to serve the silo: HTTP 409" in out.problems[0], out.problems


def test_a_log_restored_from_a_backup_and_grown_again_breaks_a_promise_with_a_proof(
    world: World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    world.train("a", 1, "a")
    assert world.check("a").ok
    database = world.url.removeprefix("sqlite:///")
    with sqlite3.connect(database) as source, sqlite3.connect(tmp_path / "backup.db") as backup:
        source.backup(backup)
    monkeypatch.setattr(transparency, "MERGE_DELAY_MS", 50)  # promised in the log within 50 ms
    site = world.sites["a"]
    answer = world.http.post(f"/v1/silos/{site.silo_id}/charges", headers={"Authorization": f"Bearer {site.key}"},
                             json={"mechanism": STEP, "idempotency_key": "lost"}).json()
    from dpledger.wire.receipts import Receipt

    receipt_store.append(site.folder, [Receipt(**answer["receipt"])])  # a worker that crashed before completing it
    with sqlite3.connect(tmp_path / "backup.db") as backup, sqlite3.connect(database) as live:
        backup.backup(live)  # the operator restores last night's backup
    world.train("b", 2, "b")  # and the log grows again past the lost entry's place
    time.sleep(0.1)
    out = world.check("a")
    assert any(p.startswith("BROKEN PROMISE:") for p in out.problems), out.problems
    assert "broken promise" in [check_proof(evidence) for evidence in out.evidence]


def test_a_promise_an_earlier_client_left_pending_is_completed_by_the_next_one(world: World) -> None:
    """A Flower round's client closes right after its commit, before the sequencer logs it; the next
    round's client completes it (it reads the tail of the silo's file at close)."""
    site = world.sites["a"]
    answer = world.http.post(f"/v1/silos/{site.silo_id}/charges", headers={"Authorization": f"Bearer {site.key}"},
                             json={"mechanism": STEP, "idempotency_key": "earlier"}).json()
    from dpledger.wire.receipts import Receipt

    receipt_store.append(site.folder, [Receipt(**answer["receipt"])])
    assert [r.included for r in receipt_store.load(site.folder).receipts] == [False]
    world.train("a", 1, "next")
    kept = receipt_store.load(site.folder).receipts
    assert len(kept) == 3 and kept[0].leaf_hash == answer["receipt"]["leaf_hash"] and kept[0].included
