"""Issue 41 item 4: the checking tools never crash on a hostile ledger. Each edited, malformed or
contradictory record is a finding (exit 1), "could not ask" is exit 2, and one bad silo never stops
the check of the others; a seal that changed a budget says from what to what. The ledger of
tests/service/test_transparency.py (silos a and b, an auditor), edited by SQL as its operator would."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from dpledger.audit import held, transparency, witnessed
from dpledger.audit.transparency import audit, verify_receipts
from dpledger.cli import main
from dpledger.harness import free_port
from dpledger.people.terminal import CliError
from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from dpledger.wire import note, receipt_store
from dpledger.wire.client import LedgerClient, Retry
from dpledger.witness.cosigner import LedgerLog
from tests.conftest import ADMIN, ADMIN_KEY, bearer
from tests.service.test_transparency import Ledger, Operator, build, problems, write_key
from tests.wire.proof_checker import check_proof

URL = "http://ledger.test"


@pytest.fixture
def ledger(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY, signing_key_file=write_key(tmp_path / "key.pem"),
                              log_sequence_interval_ms=10))
    # A 500 is an answer here, as over the network (the service's own crash on such a record is not this test's).
    http = TestClient(app, raise_server_exceptions=False)
    monkeypatch.setattr(transparency, "_client", lambda _url, key: LedgerClient(URL, key, http=http, receipts=False,
                                                                               retry=Retry(window=0)))
    monkeypatch.setenv("DPLEDGER_URL", URL)
    yield build(http)
    app.state.engine.dispose()


@pytest.fixture
def operator(url: str) -> Iterator[Operator]:
    op = Operator(url)
    yield op
    op.dispose()


def flat_filter(operator: Operator, silo_id: int) -> None:
    """The silo's filter with all of δ on its first order and none on the others: weights [1, 0, …]."""
    with operator.engine.begin() as connection:
        spec = json.loads(connection.execute(text("SELECT filter_spec FROM silos WHERE id = :id"), {"id": silo_id}).scalar_one())
        spec["weights"] = [1.0] + [0.0] * (len(spec["weights"]) - 1)
        connection.execute(text("UPDATE silos SET filter_spec = :f WHERE id = :id"), {"f": json.dumps(spec), "id": silo_id})


def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], key: str, *args: str) -> tuple[int, str]:
    monkeypatch.setenv("DPLEDGER_KEY", key)
    code = main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out


def keep(ledger: Ledger, folder: Path) -> None:
    receipt_store.append(folder, ledger.a.receipts + ledger.b.receipts)


@pytest.mark.parametrize("recomputed", [False, True], ids=["naive", "every-hash-recomputed"])
def test_edited_filter_weights_are_a_finding_for_the_silo_and_the_auditor_and_the_other_silo_is_still_checked(
    ledger: Ledger, operator: Operator, recomputed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = ledger.ids["a"], ledger.ids["b"]
    held_head = audit(ledger.auditor.get(), None).head
    assert held_head is not None
    flat_filter(operator, a)
    # and silo b's last reserve states half its ε: a finding of its own, that a's must not hide
    b2 = ledger.ids["b2"]
    operator.sql("UPDATE ledger_entries SET epsilon_spent = epsilon_spent / 2 WHERE charge_id = :id AND event = 'reserve'", id=b2)
    if recomputed:
        operator.rebuild(recompute_epsilon=False)
    out = audit(ledger.auditor.get(), None)
    said = problems(out)
    assert not out.ok
    if recomputed:
        assert f"silo {a} entry 1: what the ledger signed does not recompose" in said or f"silo {a}" in said, said
        assert f"silo {b} entry 6 (reserve of charge {b2}) states ε=" in said, said  # the other silo, still replayed
    else:
        assert "the entry no longer matches its leaf (edited after it was logged)" in said
    folder = tmp_path / "receipts"
    keep(ledger, folder)
    for party in (ledger.a, ledger.b):
        out = held.check(party.get(), folder, public_key=None, silo=None, holder=party.headers["Authorization"][7:],
                         keep=False)
        assert not out.ok
        for evidence in out.evidence:
            check_proof(evidence)
    # The commands: exit 1, no traceback, whoever asks.
    for key in (ADMIN_KEY, ledger.auditor.headers["Authorization"][7:]):
        code, printed = cli(monkeypatch, capsys, key, "verify", "--receipts", str(folder))
        assert code == 1 and "BROKEN" in printed
        code, printed = cli(monkeypatch, capsys, key, "audit", "--since", str(tmp_path / f"head-{key[:4]}.json"))
        assert code == 1 and f"silo {b}" in printed


def test_a_seal_of_a_raised_budget_says_from_what_to_what(
    ledger: Ledger, operator: Operator, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """The budget edited in the row, then sealed by an admin: the create entry's record is recomputed
    from the row, so no signed record says 10 any more; the head file and the receipts folder kept it."""
    b = ledger.ids["b"]
    folder, head_file = tmp_path / "receipts", tmp_path / "auditor-head.json"
    keep(ledger, folder)
    silo_key, auditor_key = ledger.b.headers["Authorization"][7:], ledger.auditor.headers["Authorization"][7:]
    first = cli(monkeypatch, capsys, silo_key, "verify", "--receipts", str(folder))
    assert first[0] == 0, first[1]
    assert cli(monkeypatch, capsys, auditor_key, "audit", "--since", str(head_file))[0] == 0
    operator.sql("UPDATE silos SET epsilon = 20.0 WHERE id = :id", id=b)
    sealed = ledger.client.post(f"/v1/silos/{b}/seal", headers=ADMIN)
    assert sealed.status_code == 200, sealed.text
    went = f"silo {b}: its budget went from ε=10, as last verified, to ε=20.0 now"
    code, printed = cli(monkeypatch, capsys, auditor_key, "audit", "--since", str(head_file))
    assert code == 1 and went in printed, printed
    code, printed = cli(monkeypatch, capsys, silo_key, "verify", "--receipts", str(folder))
    assert code == 1 and went in printed, printed


def test_an_unreachable_witness_is_could_not_ask(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    http = ledger.client

    class InProcess(LedgerLog):
        def __init__(self, url: str, key: str, *, timeout: float = 30.0) -> None:
            self.url = url
            self._http = TestClient(http.app, headers=bearer(key))

        def close(self) -> None:
            pass

    monkeypatch.setattr(witnessed, "LedgerLog", InProcess)
    folder = tmp_path / "receipts"
    keep(ledger, folder)
    vkey = note.Signer.generate("witness.test/w1").verifier.encode()
    gone = f"http://127.0.0.1:{free_port()}/checkpoint={vkey}"
    code, printed = cli(monkeypatch, capsys, ledger.a.headers["Authorization"][7:], "verify", "--receipts", str(folder),
                        "--witness", gone, "--require-witnesses", "1")
    assert code == 2, printed
    assert "BROKEN" not in printed and "could not be asked" in printed


def test_a_ledger_that_cannot_serve_one_silo_is_could_not_ask_for_that_silo_only(ledger: Ledger) -> None:
    a, b = ledger.ids["a"], ledger.ids["b"]
    base = ledger.auditor.get()

    def failing(path: str, params: dict[str, Any] | None) -> Any:
        if path == f"/v1/silos/{a}":
            raise CliError(f"HTTP 500 from {path}: internal error")
        return base(path, params)

    out = verify_receipts(failing, ledger.a.receipts + ledger.b.receipts)
    assert out.problems == [] and out.unasked == [f"silo {a}: HTTP 500 from /v1/silos/{a}: internal error"]
    assert f"of silo {a}, {b} against" in out.notes[0]
