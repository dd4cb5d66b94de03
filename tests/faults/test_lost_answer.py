"""A lost answer on a redelivery: a real `dpledger serve` behind a proxy that forwards a reservation
and drops its answer.

The bug these tests pin down: delivery 1 of a round reserves and dies before it settles; delivery 2
of the same round (a new attempt, the same idempotency key) loses its first answer, retries, and is
answered the replay of delivery 1's charge. A client that took "a replay after my own retry" for its
own reservation trained the round a second time on one charge. With attempt ids the replay names
delivery 1's attempt, so delivery 2 never trains; a single attempt whose own first answer was lost is
answered its own id and trains, once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict

from dpledger.flower import records
from dpledger.flower.gate import ledger_gate, ledger_job
from dpledger.wire.client import LedgerClient
from tests.faults.conftest import BIN, LedgerServer, listed_charges, stop_tree
from tests.faults.proxy import Proxy
from tests.flower.federation import DELTA, expected_epsilon, write_silo_files
from tests.flower.test_gate import Counting, train_message

ADMIN = "faults-admin-" + os.urandom(8).hex()
TRAIN, SIGMA, STEPS, BATCH, BUDGET = 60, 1.0, 2, 12, 20.0
RESERVE = r"/v1/silos/\d+/charges"
COMMIT = r"/v1/charges/\d+/commit"
ROOT = Path(__file__).resolve().parents[2]
SETTLING = ("reserve", "commit", "release")
DIE_TIMEOUT = 120.0  # seconds for delivery 1's process to start (torch, flwr) and reach the trainer


def one_round(detail: Any, rounds: int = 1) -> float:
    return expected_epsilon(detail, rounds=rounds, steps=STEPS, sampling_rate=BATCH / TRAIN, noise_multiplier=SIGMA)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    with LedgerServer(tmp_path_factory.mktemp("ledger"), admin_key=ADMIN) as server:
        yield server


@pytest.fixture
def proxy(ledger: LedgerServer) -> Iterator[Proxy]:
    with Proxy(ledger.port) as p:
        yield p


@pytest.fixture(autouse=True)
def task_identity(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """What a `flwr-clientapp` process sets before it handles a message (messages read it); receipts
    of in-process clients go to the test's folder."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setenv("DPLEDGER_RECEIPTS", str(tmp_path / "receipts"))
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
    yield
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None  # type: ignore[assignment]


def new_silo(ledger: LedgerServer, folder: Path, *, ledger_url: str) -> tuple[int, str, dict[str, Any]]:
    """(silo id, ledger job id, the silo's node config pointing at `ledger_url`)."""
    (data,) = write_silo_files(folder, silos=1, train=TRAIN, test=10)
    with LedgerClient(ledger.url, ADMIN, receipts=False) as admin:
        created = admin.create_silo(name=f"silo-{folder.name}", epsilon=BUDGET, delta=DELTA, dataset_size=TRAIN)
        job_id = admin.create_job(name=f"job-{folder.name}", silo_ids=[created.id])
    key_file = folder / "silo.key"
    key_file.write_text(created.api_key)
    node_config = {"ledger-url": ledger_url, "silo-id": created.id, "key-file": str(key_file), "data-path": str(data),
                   "noise-multiplier": SIGMA}
    return created.id, str(job_id), node_config


def mechanism() -> dict[str, Any]:
    return {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": SIGMA, "steps": STEPS}  # BATCH < TRAIN


def assert_one_round_reserved(ledger: LedgerServer, silo_id: int, job_id: str) -> None:
    """ε on the ledger is exactly one round, all of it reserved (spent, not committed), and an
    operator listing the silo's open reservations finds that one charge."""
    with LedgerClient(ledger.url, ADMIN, receipts=False) as admin:
        detail = admin.silo(silo_id)
        history = admin.history(silo_id)
    assert detail.epsilon_spent == pytest.approx(one_round(detail), rel=1e-9)
    assert detail.epsilon_committed == 0.0
    assert [e.event for e in history if e.event in SETTLING] == ["reserve"]
    reserved = listed_charges(ledger.url, ADMIN, silo_id, status="reserved")
    assert [(c["job_id"], c["round"], c["status"]) for c in reserved] == [(job_id, 0, "reserved")]
    assert listed_charges(ledger.url, ADMIN, silo_id) == reserved


def assert_one_round_committed(ledger: LedgerServer, silo_id: int) -> None:
    with LedgerClient(ledger.url, ADMIN, receipts=False) as admin:
        detail = admin.silo(silo_id)
        history = admin.history(silo_id)
    assert detail.epsilon_committed == pytest.approx(one_round(detail), rel=1e-9)
    assert detail.epsilon_spent == pytest.approx(detail.epsilon_committed, rel=1e-12)
    assert [e.event for e in history if e.event in SETTLING] == ["reserve", "commit"]
    assert [c["status"] for c in listed_charges(ledger.url, ADMIN, silo_id)] == ["committed"]


# --- through open_round -----------------------------------------------------------------------------
def test_a_redelivery_whose_answer_is_lost_never_trains(ledger: LedgerServer, proxy: Proxy, tmp_path: Path) -> None:
    from dpledger.trainer.silo.rounds import open_round
    from dpledger.wire.errors import NotOwned

    silo_id, job_id, node = new_silo(ledger, tmp_path, ledger_url=proxy.url)
    key = Path(node["key-file"]).read_text()
    # Delivery 1 reserves (201), may have read the data, and dies: its permit is never settled.
    with LedgerClient(proxy.url, key, receipts=False) as first:
        permit = open_round(first, silo_id=silo_id, job_id=job_id, round=0, mechanism=mechanism())
        permit.touch()
    assert [(e.status, e.answered) for e in proxy.seen(RESERVE)] == [(201, True)]
    # Delivery 2: a new attempt of the same round; its first answer is lost, its retry is the replay.
    proxy.add(RESERVE, action="drop_response")
    with LedgerClient(proxy.url, key, receipts=False) as second, pytest.raises(NotOwned):
        open_round(second, silo_id=silo_id, job_id=job_id, round=0, mechanism=mechanism())
    assert [(e.status, e.answered) for e in proxy.seen(RESERVE)[1:]] == [(200, False), (200, True)]
    assert proxy.seen(COMMIT) == [] and proxy.seen(r"/v1/charges/\d+/release") == []
    assert_one_round_reserved(ledger, silo_id, job_id)


def test_an_attempt_whose_own_answer_is_lost_trains_once(ledger: LedgerServer, proxy: Proxy, tmp_path: Path) -> None:
    from dpledger.trainer.silo.rounds import open_round

    silo_id, job_id, node = new_silo(ledger, tmp_path, ledger_url=proxy.url)
    proxy.add(RESERVE, action="drop_response")
    trained = 0
    with LedgerClient(proxy.url, Path(node["key-file"]).read_text(), receipts=False) as client:
        with open_round(client, silo_id=silo_id, job_id=job_id, round=0, mechanism=mechanism()) as permit:
            permit.touch()
            trained += 1
    assert trained == 1
    assert [(e.status, e.answered) for e in proxy.seen(RESERVE)] == [(201, False), (200, True)]
    assert [(e.status, e.answered) for e in proxy.seen(COMMIT)] == [(200, True)]
    assert_one_round_committed(ledger, silo_id)


# --- through the Flower mod -------------------------------------------------------------------------
DELIVERY_ONE = """
import json, sys, time
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
from dpledger.flower.gate import ledger_gate, ledger_job
from tests.faults.test_lost_answer import train_message
node, job_id = json.loads(sys.argv[1]), int(sys.argv[2])

def trainer(message, context):
    print("TRAINING", flush=True)  # the approval was granted: the data may be read from here on
    time.sleep(600)

ledger_gate(train_message(job_id, 0), Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={}), trainer)
print("RETURNED", flush=True)
"""


def deliver_and_die(node: dict[str, Any], job_id: str, folder: Path) -> None:
    """Delivery 1 in a process of its own, SIGKILLed once the mod has handed the round to the trainer."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPLEDGER_RECEIPTS": str(folder / "receipts-1")}
    process = subprocess.Popen([str(BIN / "python"), "-c", DELIVERY_ONE, json.dumps(node), job_id], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout is not None
        # The line comes or the process ends (closing its pipe); a hang is ended by the timer's kill.
        timer = threading.Timer(DIE_TIMEOUT, process.kill)
        timer.start()
        try:
            line = process.stdout.readline().decode()
        finally:
            timer.cancel()
        if line.strip() != "TRAINING":
            stop_tree(process)
            assert process.stderr is not None
            pytest.fail(f"delivery 1 did not reach the trainer: {line!r}\n{process.stderr.read().decode()[-3000:]}")
    finally:
        stop_tree(process, signal.SIGKILL)


def test_a_redelivered_train_message_whose_answer_is_lost_never_trains(ledger: LedgerServer, proxy: Proxy,
                                                                       tmp_path: Path) -> None:
    silo_id, job_id, node = new_silo(ledger, tmp_path, ledger_url=proxy.url)
    deliver_and_die(node, job_id, tmp_path)
    assert [(e.status, e.answered) for e in proxy.seen(RESERVE)] == [(201, True)]
    charged_as = ledger_job(int(job_id))  # the job name the mod's charges carry
    assert_one_round_reserved(ledger, silo_id, charged_as)

    proxy.add(RESERVE, action="drop_response")
    trainer = Counting()
    context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})
    reply = ledger_gate(train_message(int(job_id), 0), context, trainer)
    assert trainer.calls == 0
    assert records.reply_status(reply) == records.REPLAYED
    assert list(reply.content.keys()) == [records.STATUS]  # no model, no numbers
    assert [(e.status, e.answered) for e in proxy.seen(RESERVE)[1:]] == [(200, False), (200, True)]
    assert proxy.seen(COMMIT) == []
    assert_one_round_reserved(ledger, silo_id, charged_as)


def test_a_train_message_whose_own_answer_is_lost_trains_once(ledger: LedgerServer, proxy: Proxy, tmp_path: Path) -> None:
    silo_id, job_id, node = new_silo(ledger, tmp_path, ledger_url=proxy.url)
    proxy.add(RESERVE, action="drop_response")
    trainer = Counting()
    context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})
    reply = ledger_gate(train_message(int(job_id), 0), context, trainer)
    assert records.reply_status(reply) == records.TRAINED
    assert trainer.calls == 1
    assert [(e.status, e.answered) for e in proxy.seen(RESERVE)] == [(201, False), (200, True)]
    assert_one_round_committed(ledger, silo_id)
    # The same message delivered again is a replay of a committed charge: no second training.
    again = ledger_gate(train_message(int(job_id), 0), context, trainer)
    assert records.reply_status(again) == records.REPLAYED and trainer.calls == 1
    assert_one_round_committed(ledger, silo_id)
