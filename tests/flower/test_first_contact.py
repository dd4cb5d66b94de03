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

from dpledger.flower import server_app
from dpledger.flower.settings import FIRST_CONTACT_SECONDS, RunSettings, SettingsError
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
