"""A ClientApp stopped mid-round (SIGTERM from its SuperNode or an operator) settles its round by the
one settle rule before the process ends: the round may have read data, so its charge is committed,
not left reserved."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import os
import signal
import time
from pathlib import Path

from flwr.app import Context, Message

from dpledger.flower.gate import ledger_gate
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import ChargeStatus
from tests.flower.test_gate import ADMIN, ledger, silo_context, task_identity, train_message  # noqa: F401


def unhandled(number: int, _: object) -> None:
    raise AssertionError("the mod left SIGTERM to the process's own handler")


def stopped_mid_training(message: Message, context: Context) -> Message:
    os.kill(os.getpid(), signal.SIGTERM)  # a real signal to this process, handled in its main thread
    time.sleep(30)
    raise AssertionError("SIGTERM did not stop the round")


def test_sigterm_mid_training_commits_the_rounds_charge(ledger: str, tmp_path: Path,  # noqa: F811
                                                        caplog: pytest.LogCaptureFixture) -> None:
    job_id, context = silo_context(ledger, tmp_path, budget=10.0)
    # Should the mod not take SIGTERM over, this says so (Python's default would end the test run).
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(KeyboardInterrupt):
            ledger_gate(train_message(job_id, 0), context, stopped_mid_training)
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the mod's handler was the round's only
    finally:
        signal.signal(signal.SIGTERM, before)
    silo_id = int(context.node_config["silo-id"])
    with LedgerClient(ledger, ADMIN) as admin:
        charges = admin.charges(silo_id)
    assert [(c.round, c.status) for c in charges] == [(0, ChargeStatus.committed)]
    assert f"[silo {silo_id}] round 1 interrupted: charge {charges[0].charge_id} committed (the round may have read data)" \
        in [r.getMessage() for r in caplog.records]
