"""Issue 41 items 2 and 5: receipts kept per ledger and per silo, completed by the client, and the
default `dpledger verify --receipts` quiet on an honest ledger.

One account (one receipts folder) speaks to two ledgers (two databases, two signing keys), two silos
on each, as a new user's machine ends up: the trainer's client keeps every receipt there. Each key
then runs `dpledger verify --receipts` with the default folder against its own ledger: a silo key
checks its own silo's receipts, an admin's or auditor's every silo's of that ledger, and all say ok,
leaving the others aside. The command runs whole (`dpledger.cli.main`), its HTTP client pointed at the
in-process apps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dpledger.audit import transparency
from dpledger.cli import main
from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from dpledger.wire import receipt_store
from dpledger.wire.client import LedgerClient, Retry
from dpledger.wire.receipts import Receipt, check_receipt
from tests.conftest import ADMIN, ADMIN_KEY, TEST_HORIZON
from tests.service.test_transparency import STEP, write_key


@dataclass
class Ledger:
    url: str
    http: TestClient
    silos: list[tuple[int, str]]  # (id, key)
    auditor: str


@pytest.fixture
def ledgers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[Ledger], Path]]:
    folder = tmp_path / "receipts"
    monkeypatch.setenv("DPLEDGER_RECEIPTS", str(folder))
    made, apps = [], []
    for n in range(2):
        database = f"sqlite:///{tmp_path}/ledger{n}.db"
        from dpledger.service.store.db import migrate

        migrate(database)
        app = create_app(Settings(database_url=database, admin_key=ADMIN_KEY,
                                  signing_key_file=write_key(tmp_path / f"key{n}.pem"), log_sequence_interval_ms=10))
        apps.append(app)
        http = TestClient(app)
        silos = []
        for name in ("north", "south"):
            created = http.post("/v1/silos", headers=ADMIN, json={"name": name, "epsilon": 10.0, "delta": 1e-5,
                                                                  "dataset_size": 1000, "horizon": TEST_HORIZON}).json()
            silos.append((created["id"], created["api_key"]))
        auditor = http.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]
        made.append(Ledger(f"http://ledger{n}.test", http, silos, auditor))
    # `dpledger`'s client, pointed at the in-process apps by URL.
    by_url = {ledger.url: ledger.http for ledger in made}
    monkeypatch.setattr(transparency, "_client",
                        lambda url, key: LedgerClient(url, key, http=by_url[url], receipts=False,
                                                             retry=Retry(window=0)))
    yield made, folder
    for app in apps:
        app.state.engine.dispose()


def train(ledger: Ledger, silo: tuple[int, str], rounds: int, label: str) -> None:
    """What the trainer's client does each round: reserve, then commit; its receipts kept by default."""
    silo_id, key = silo
    with LedgerClient(ledger.url, key, http=ledger.http) as client:
        for r in range(rounds):
            charge = client.reserve(silo_id, mechanism=STEP, idempotency_key=f"{label}{r}", job_id=label, round=r)
            client.commit(charge.charge_id)


def verify(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ledger: Ledger, key: str,
           *args: str) -> tuple[int, str]:
    monkeypatch.setenv("DPLEDGER_URL", ledger.url)
    monkeypatch.setenv("DPLEDGER_KEY", key)
    code = main(["verify", "--receipts", *args])
    return code, capsys.readouterr().out


def test_several_ledgers_and_silos_in_one_folder_each_key_checks_its_own_and_an_honest_ledger_is_quiet(
    ledgers: tuple[list[Ledger], Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made, folder = ledgers
    for n, ledger in enumerate(made):
        for s, silo in enumerate(ledger.silos):
            train(ledger, silo, rounds=2 + s, label=f"l{n}s{s}")
    # Kept by ledger (its log key's id) and by silo: 2 ledgers × 2 silos, each file that silo's alone.
    held = receipt_store.load(folder)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jsonl"))
    assert len(files) == 4 and len({f.split("/")[0] for f in files}) == 2
    for path in folder.rglob("silo-*.jsonl"):
        silo_ids = {Receipt.model_validate_json(line).silo_id for line in path.read_text().splitlines()}
        assert silo_ids == {int(path.stem.removeprefix("silo-"))}
    assert len(held.receipts) == 2 * (4 + 6)  # a receipt per reserve and per commit
    assert len(held.key_ids()) == 2
    for ledger in made:
        for s, (silo_id, key) in enumerate(ledger.silos):
            code, out = verify(monkeypatch, capsys, ledger, key)
            mine = 2 * (2 + s)
            assert code == 0 and "BROKEN" not in out, out
            assert out.startswith(f"ok: {mine} receipts, "), out
            assert f"entries of silo {silo_id} against the head of size " in out
            assert "ok: left aside 10 receipts of 1 other ledger(s), signed by other keys" in out
            assert f"ok: left aside {10 - mine} receipts of other silos of this ledger (this check reads silo {silo_id})" in out
        for key in (ADMIN_KEY, ledger.auditor):  # every silo's of this ledger
            code, out = verify(monkeypatch, capsys, ledger, key)
            assert code == 0 and "BROKEN" not in out, out
            ids = ", ".join(str(i) for i, _ in ledger.silos)
            assert out.startswith("ok: 10 receipts, ") and f"entries of silo {ids} against" in out, out
        # --silo narrows an admin's check to one silo
        code, out = verify(monkeypatch, capsys, ledger, ADMIN_KEY, "--silo", str(ledger.silos[1][0]))
        assert code == 0 and out.startswith("ok: 6 receipts, "), out
    # What the client kept is complete: each receipt with its index, a signed head and its path (the
    # client completes at its next answers and at close; the check completes the rest and keeps them).
    held = receipt_store.load(folder)
    assert all(r.included for r in held.receipts)
    keys = {}
    for ledger in made:
        public = ledger.http.get("/v1/log/public-key", headers=ADMIN).json()
        keys[public["key_id"]] = bytes.fromhex(public["public_key"])
    for r in held.receipts:
        check_receipt(r, keys[receipt_store.key_id_of(r)])
    for key_id in keys:  # and the newest verified head of each ledger, beside its receipts
        kept = json.loads((receipt_store.ledger_folder(folder, key_id) / receipt_store.HEAD_FILE).read_text())
        assert kept["head"]["key_id"] == key_id


def test_a_ledger_that_changed_its_key_is_named_to_the_keys_that_hold_its_receipts_and_no_other(
    ledgers: tuple[list[Ledger], Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    (first, second), _ = ledgers
    train(first, first.silos[0], rounds=1, label="a")
    train(second, second.silos[0], rounds=1, label="b")
    # The first ledger restarts with another key (a development ledger does at every restart).
    again = create_app(Settings(database_url=str(first.http.app.state.engine.url), admin_key=ADMIN_KEY,  # type: ignore[attr-defined]
                                signing_key_file=write_key(tmp_path / "another.pem")))
    restarted = Ledger(first.url, TestClient(again), first.silos, first.auditor)
    monkeypatch.setattr(transparency, "_client",
                        lambda url, key: LedgerClient(url, key, http={first.url: restarted.http,
                                                                      second.url: second.http}[url], receipts=False))
    try:
        code, out = verify(monkeypatch, capsys, restarted, first.silos[0][1])
        assert code == 1 and "the ledger's signing key changed: 2 receipts this key received were signed by key" in out, out
        # The other silo of that ledger never received any: nothing of its own to check (exit 2, said).
        monkeypatch.setenv("DPLEDGER_KEY", first.silos[1][1])
        assert main(["verify", "--receipts"]) == 2
        assert "no receipts of this ledger" in capsys.readouterr().err
        # The second ledger is untouched: its silo's check is as quiet as before.
        code, out = verify(monkeypatch, capsys, second, second.silos[0][1])
        assert code == 0 and "BROKEN" not in out, out
    finally:
        again.state.engine.dispose()


def test_a_receipts_folder_of_an_earlier_version_is_read_and_its_heads_checked(
    ledgers: tuple[list[Ledger], Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A flat receipts.jsonl (before receipts were kept per ledger) still reads, beside the new layout."""
    made, folder = ledgers
    ledger = made[0]
    silo_id, key = ledger.silos[0]
    answer: dict[str, Any] = ledger.http.post(f"/v1/silos/{silo_id}/charges", headers={"Authorization": f"Bearer {key}"},
                                              json={"mechanism": STEP, "idempotency_key": "old"}).json()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "receipts.jsonl").write_text(json.dumps(answer["receipt"]) + "\n")
    code, out = verify(monkeypatch, capsys, ledger, key)
    assert code == 0 and out.startswith("ok: 1 receipts, "), out
    assert "1 receipts completed" in out  # the promise, found in the log, kept completed in the new layout
    assert receipt_store.load(folder).receipts[0].included
