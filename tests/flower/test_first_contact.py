"""A run where too few silos answer their first message ends with run.json ("nothing trained") and one
line naming the silent SuperNodes and the setting to raise; first contact has a timeout of its own."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the `flower` extra)")

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict

from dpledger.flower import records, server_app
from dpledger.flower.settings import FIRST_CONTACT_SECONDS, RunSettings, SettingsError
from dpledger.harness import running_server
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import Role
from tests.flower.test_settings import RUN


class SilentGrid:
    """Three connected SuperNodes that never answer: messages are taken and nothing comes back."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes, self.pushed = nodes, 0

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
        ids = [f"message-{self.pushed + i}" for i, _ in enumerate(messages)]
        self.pushed += len(ids)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        return []


@dataclass
class Context:
    run_config: dict[str, Any]
    run_id: int = 1


def test_first_contact_waits_its_own_timeout_then_says_what_to_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # as a ServerApp process has them: its messages name them
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    out = tmp_path / "run.json"
    config = {**RUN, "round-timeout": 60.0, "first-contact-timeout": 0.4, "out": str(out)}
    began = time.monotonic()
    with pytest.raises(server_app.NothingTrained) as raised:
        server_app.main(SilentGrid([7, 8, 9]), Context(config))  # type: ignore[arg-type]  # the grid's calls only
    assert 0.4 <= time.monotonic() - began < 30  # first-contact-timeout, not round-timeout (60 s)
    line = ("nothing trained: 0 of 3 SuperNodes answered within first-contact-timeout=0.4 s, fewer than min-nodes=3; "
            "silent: node 7, node 8, node 9 (see those SuperNodes' logs); raise first-contact-timeout (run config) "
            "on a busy machine")
    assert str(raised.value) == line
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [line]
    written = json.loads(out.read_text())
    assert (written["outcome"], written["reason"], written["silent_nodes"], written["silos"]) == (
        "nothing trained", line, [7, 8, 9], {})


def test_first_contact_timeout_defaults_to_the_apps_and_is_checked() -> None:
    assert RunSettings.from_run_config(RUN).first_contact_timeout == FIRST_CONTACT_SECONDS == 600.0
    app = Path(server_app.__file__).parent / "app" / "pyproject.toml"
    assert "first-contact-timeout = 600.0\n" in app.read_text()
    with pytest.raises(SettingsError) as raised:
        RunSettings.from_run_config({**RUN, "first-contact-timeout": 0.0})
    assert str(raised.value) == "run config: 'first-contact-timeout' must be > 0. Found 0.0."


class AnswersOnlyItsId(SilentGrid):
    """SuperNodes that answer first contact (silo k on node k) and then nothing: every train message
    is taken, and no ClientApp ever replies to it (a machine too busy for one to start in time)."""

    def __init__(self, nodes: list[int]) -> None:
        super().__init__(nodes)
        self.kinds: list[str] = []
        self.replies: dict[str, Any] = {}

    def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for message_id, message in zip(ids, messages, strict=True):
            self.kinds.append(message.metadata.message_type)
            if message.metadata.message_type == "query":
                self.replies[message_id] = Message(
                    RecordDict({records.CONFIG: ConfigRecord({"silo-id": message.metadata.dst_node_id})}), reply_to=message)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def test_a_round_no_silo_replies_to_ends_the_run_with_what_to_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every silo answered first contact, none replied in round 1 within all the time the settings
    allow: the run stops there (round 2 would wait as long, while each gate may spend another
    charge on an update that comes too late), with run.json up to that round and one line."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    admin_key = "silent-round-admin-key"
    with running_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}", admin_key=admin_key) as url:
        with LedgerClient(url, admin_key) as admin:
            silos = [admin.create_silo(name=f"site-{k}", epsilon=3.0, delta=1e-5, dataset_size=400).id for k in (1, 2, 3)]
            (tmp_path / "coordinator.key").write_text(admin.create_key(role=Role.coordinator).api_key)
        out = tmp_path / "run.json"
        config = {**RUN, "rounds": 3, "round-timeout": 0.3, "first-contact-timeout": 0.5, "ledger-url": url,
                  "coordinator-key-file": str(tmp_path / "coordinator.key"), "out": str(out)}
        grid = AnswersOnlyItsId(silos)
        with pytest.raises(server_app.SilentRound) as raised:
            server_app.main(grid, Context(config))  # type: ignore[arg-type]  # the grid's calls only
    assert str(raised.value) == "round 1: none of the 3 silos asked replied within 1 s"  # 0.3 + 0.5, no reply to measure
    assert grid.kinds == ["query"] * 3 + ["train"] * 3  # round 2 never asked, nothing evaluated
    line = ("job 1 nothing trained after 1 of 3 rounds (round 1: none of the 3 silos asked replied within 1 s: on a "
            "machine this busy, raise first-contact-timeout (the longest start-up a round waits for) or round-timeout): "
            "the out JSON holds those rounds; each silo's ledger holds what its rounds spent; continue it with the same "
            "run config and resume=true")
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [line]
    written = json.loads(out.read_text())
    assert (written["outcome"], written["reason"]) == ("nothing trained", line)
    assert [entry["status"] for entry in written["rounds"]] == [{str(s): "no reply" for s in silos}]
    assert written["rounds"][0]["timeout"] == pytest.approx(0.8)
