"""A round's timeout stretches by the start-up its ClientApps take on this machine (server_app.Pace):
each message starts a ClientApp process, minutes on a busy machine, and `round-timeout` is meant
for the training. Driven through the ServerApp's own exchange on a grid whose SuperNodes answer
after a start-up delay far longer than `round-timeout`."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from dpledger.flower import records, server_app

STARTUP = 0.6  # seconds each ClientApp takes before it answers anything
TRAIN, LEDGER = 0.2, 0.1  # seconds a trained reply says it spent training and at the ledger
ROUND_TIMEOUT = 0.3  # shorter than a start-up: a fixed timeout would hear nothing


class SlowGrid:
    """SuperNodes whose every answer comes STARTUP s after the message (plus TRAIN + LEDGER for a
    train message, whose reply reports those seconds as a silo's does)."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes
        self.due: dict[str, tuple[float, Any]] = {}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
        ids = []
        for message in messages:
            node, train = message.metadata.dst_node_id, message.metadata.message_type == "train"
            message_id = f"message-{len(self.due)}"
            metrics = {records.METRICS: {"train-seconds": TRAIN, "ledger-seconds": LEDGER}} if train else {}
            config = {} if train else {records.CONFIG: {"silo-id": node}}
            reply = SimpleNamespace(
                metadata=SimpleNamespace(reply_to_message_id=message_id, src_node_id=node),
                content=SimpleNamespace(metric_records=metrics, config_records=config), has_error=lambda: False)
            self.due[message_id] = (time.monotonic() + STARTUP + (TRAIN + LEDGER if train else 0.0), reply)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        now = time.monotonic()
        return [self.due[i][1] for i in message_ids if self.due[i][0] <= now]


def message(node: int, kind: str) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node, message_type=kind))


def test_a_round_waits_round_timeout_beyond_the_start_up_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # as a ServerApp process has them: its messages name them
        monkeypatch.setattr(TaskIdentity, name, 1)
    grid = SlowGrid([1, 2, 3])
    pace = server_app.Pace(ceiling=600.0)
    # First contact (its own, long timeout) measures the start-up: every node answers after STARTUP.
    assert server_app._ask_silo_ids(grid, [1, 2, 3], 600.0, pace) == {1: 1, 2: 2, 3: 3}  # type: ignore[arg-type]  # the grid's calls only
    assert STARTUP <= pace.startup < STARTUP + 0.5
    assert pace.timeout(ROUND_TIMEOUT) == pytest.approx(ROUND_TIMEOUT + server_app.STARTUP_SLACK * pace.startup)

    # A train round with round-timeout < start-up still hears every silo...
    fast = server_app.FastGrid(grid, pace)  # type: ignore[arg-type]  # idem
    replies = list(fast.send_and_receive([message(n, "train") for n in (1, 2, 3)], timeout=ROUND_TIMEOUT))
    assert sorted(r.metadata.src_node_id for r in replies) == [1, 2, 3]
    # ...and measures the start-up again from the reply: its wait less the seconds the silo reported.
    assert STARTUP <= pace.startup < STARTUP + 0.5

    assert pace.allowed == pytest.approx(pace.timeout(ROUND_TIMEOUT))  # what the round's out entry records


def test_a_machine_grown_slower_since_the_last_measurement_still_hears_every_silo(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round whose measured start-up is stale (here none at all: the shared server got busier since
    first contact) waits for its first reply up to round-timeout + first-contact-timeout, measures the
    start-up from it, and hears the rest; a ceiling too short for any reply still ends the round."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    grid = SlowGrid([1, 2, 3])
    stale = server_app.Pace(ceiling=600.0)
    fast = server_app.FastGrid(grid, stale)  # type: ignore[arg-type]  # the grid's calls only
    started = time.monotonic()
    replies = list(fast.send_and_receive([message(n, "train") for n in (1, 2, 3)], timeout=ROUND_TIMEOUT))
    assert sorted(r.metadata.src_node_id for r in replies) == [1, 2, 3]
    assert time.monotonic() - started < STARTUP + TRAIN + LEDGER + 1.0  # it waited for the replies, not the ceiling
    assert STARTUP <= stale.startup < STARTUP + 0.5
    assert stale.allowed == pytest.approx(stale.timeout(ROUND_TIMEOUT))

    # first-contact-timeout bounds the wait for a first reply: past it the round ends, having heard nothing.
    capped = server_app.Pace(ceiling=0.1)
    assert list(server_app.FastGrid(grid, capped).send_and_receive(  # type: ignore[arg-type]  # idem
        [message(n, "train") for n in (1, 2, 3)], timeout=ROUND_TIMEOUT)) == []
    assert capped.allowed == pytest.approx(ROUND_TIMEOUT + 0.1)


def test_the_start_up_allowance_is_capped_at_first_contact_timeout() -> None:
    pace = server_app.Pace(ceiling=5.0)
    pace.saw(1.0)
    pace.saw(0.5)  # the slowest start-up counts
    assert pace.timeout(10.0) == 10.0 + server_app.STARTUP_SLACK * 1.0
    pace.saw(400.0)
    assert pace.timeout(10.0) == 15.0
