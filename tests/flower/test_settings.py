"""Node and run settings: each missing or bad value is refused with its name and the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpledger.flower.settings import SIMULATION_NODES_ENV, ConfigValue, RunSettings, SettingsError, SiloSettings

NODE: dict[str, ConfigValue] = {"ledger-url": "http://127.0.0.1:8000", "silo-id": 3, "key-file": "/k", "data-path": "/d.npz",
                                "noise-multiplier": 1.1}
RUN: dict[str, ConfigValue] = {
    "algorithm": "fedavg", "rounds": 4, "local-steps": 5, "batch-size": 16, "lr": 0.5, "clip-norm": 1.0, "lam": 0.0,
    "server-noise": 1.0, "update-clip": 1.0, "seed": 0, "min-nodes": 3, "round-timeout": 60.0,
    "ledger-url": "http://127.0.0.1:8000", "coordinator-key-file": "/c", "out": ""}


def test_a_node_config_parses() -> None:
    silo = SiloSettings.from_node_config(NODE)
    assert (silo.silo_id, silo.noise_multiplier, silo.key_file) == (3, 1.1, Path("/k"))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("silo-id", 0, "node config: 'silo-id' must be an integer >= 1. Found 0."),
    ("silo-id", True, "node config: 'silo-id' must be an integer >= 1. Found True."),
    ("noise-multiplier", 0.0, "node config: 'noise-multiplier' must be > 0. Found 0.0."),
    ("noise-multiplier", float("nan"), "node config: 'noise-multiplier' must be a finite number. Found nan."),
    ("key-file", "", "node config: 'key-file' must be a non-empty string. Found ''."),
])
def test_a_bad_node_value_is_named(key: str, value: object, message: str) -> None:
    with pytest.raises(SettingsError) as raised:
        SiloSettings.from_node_config({**NODE, key: value})  # type: ignore[dict-item]  # deliberately wrong types
    assert str(raised.value) == message


def test_a_missing_node_value_is_named() -> None:
    with pytest.raises(SettingsError) as raised:
        SiloSettings.from_node_config({k: v for k, v in NODE.items() if k != "data-path"})
    assert str(raised.value) == "node config: missing 'data-path'."


def test_the_key_file_must_exist_and_hold_a_key(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot be read"):
        SiloSettings.from_node_config({**NODE, "key-file": str(tmp_path / "missing")}).api_key()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        SiloSettings.from_node_config({**NODE, "key-file": str(tmp_path / "empty")}).api_key()
    (tmp_path / "key").write_text("secret\n")
    assert SiloSettings.from_node_config({**NODE, "key-file": str(tmp_path / "key")}).api_key() == "secret"


def test_a_run_config_parses_and_refuses_an_unknown_algorithm() -> None:
    run = RunSettings.from_run_config(RUN)
    assert (run.algorithm, run.rounds, run.out) == ("fedavg", 4, None)
    with pytest.raises(SettingsError) as raised:
        RunSettings.from_run_config({**RUN, "algorithm": "fedprox"})
    assert str(raised.value) == (
        "run config: 'algorithm' must be one of ditto, fedavg, fedhdp, finetune, ifca, ifca_mrmtl, local, mrmtl, pfa, "
        "pmtl, ppsgd. Found 'fedprox'."
    )


def test_a_virtual_node_reads_its_partitions_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's simulation engine gives a virtual node only its partition id: its silo settings are
    the partition's entry of the file DPLEDGER_SIMULATION_NODES names, never the run config."""
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([NODE, {**NODE, "silo-id": 7, "noise-multiplier": 2.5}]))
    monkeypatch.setenv(SIMULATION_NODES_ENV, str(nodes))
    silo = SiloSettings.of_node({"partition-id": 1, "num-partitions": 2})
    assert (silo.silo_id, silo.noise_multiplier) == (7, 2.5)
    # A real SuperNode's own node config wins, whatever the environment says.
    assert SiloSettings.of_node({**NODE, "partition-id": 1}).silo_id == 3
    with pytest.raises(SettingsError) as raised:
        SiloSettings.of_node({"partition-id": 2, "num-partitions": 3})
    assert str(raised.value) == f"{SIMULATION_NODES_ENV} {str(nodes)!r} must be a JSON list with an object for partition 2."
    nodes.write_text("[{")
    with pytest.raises(SettingsError, match="is not JSON"):
        SiloSettings.of_node({"partition-id": 0})
    nodes.write_text(json.dumps([{**NODE, "silo-id": 0}]))
    with pytest.raises(SettingsError, match="'silo-id' must be an integer >= 1"):
        SiloSettings.of_node({"partition-id": 0})
    monkeypatch.delenv(SIMULATION_NODES_ENV)
    with pytest.raises(SettingsError, match=f"partition-id=0\\) needs {SIMULATION_NODES_ENV}"):
        SiloSettings.of_node({"partition-id": 0})


@pytest.mark.parametrize("content", [
    "dpl_bare-key\n",
    '{"key_id": 7, "api_key": "dpl_bare-key"}\n',  # what `dpledger keys create` prints
    '{\n  "id": 1,\n  "name": "site-a",\n  "api_key": "dpl_bare-key"\n}\n',  # `dpledger silos create --json`
])
def test_a_key_file_holds_the_bare_key_or_the_json_the_cli_prints(tmp_path: Path, content: str) -> None:
    (tmp_path / "key").write_text(content)
    assert SiloSettings.from_node_config({**NODE, "key-file": str(tmp_path / "key")}).api_key() == "dpl_bare-key"
    assert RunSettings.from_run_config({**RUN, "coordinator-key-file": str(tmp_path / "key")}).coordinator_key() == "dpl_bare-key"


@pytest.mark.parametrize(("content", "reason"), [
    ('{"key_id": 7}', 'is JSON without an "api_key" string (the field `dpledger keys create` prints).'),
    ('{"api_key": 7}', 'is JSON without an "api_key" string (the field `dpledger keys create` prints).'),
    ('["dpl_bare-key"]', 'is JSON without an "api_key" string (the field `dpledger keys create` prints).'),
    ('{"api_key": "dpl_', "starts with '{' but is not JSON (Unterminated string starting at)."),
    ("dpl_one\ndpl_two\n", "must hold the bare key or the JSON `dpledger keys create` prints. Found more than one word."),
])
def test_a_key_file_holding_anything_else_is_refused_in_one_line_that_shows_no_key(
    tmp_path: Path, content: str, reason: str
) -> None:
    path = tmp_path / "key"
    path.write_text(content)
    with pytest.raises(SettingsError) as raised:
        RunSettings.from_run_config({**RUN, "coordinator-key-file": str(path)}).coordinator_key()
    assert str(raised.value) == f"run config: 'coordinator-key-file' {reason}"
    assert "\n" not in str(raised.value) and "dpl_" not in str(raised.value)
    with pytest.raises(SettingsError) as raised:
        SiloSettings.from_node_config({**NODE, "key-file": str(path)}).api_key()
    assert str(raised.value) == f"node config: 'key-file' {str(path)!r} {reason}"


def test_an_algorithms_options_come_from_its_own_keys_and_a_bad_one_is_named() -> None:
    """Each registered algorithm reads its options from flat keys named after them; the run copies
    exactly those into its train messages, and a bad or missing one fails the run before any silo is asked."""
    ifca = RunSettings.from_run_config({**RUN, "algorithm": "ifca", "clusters": 3, "selection-noise-multiplier": 2.5})
    assert ifca.options == {"clusters": 3, "selection-noise-multiplier": 2.5}
    assert ifca.halves.silo.selection.noise_multiplier == 2.5  # type: ignore[attr-defined]
    with pytest.raises(SettingsError) as raised:
        RunSettings.from_run_config({**RUN, "algorithm": "ifca_mrmtl", "clusters": 2})
    assert str(raised.value) == "run config: ifca_mrmtl needs selection-rounds."
    with pytest.raises(SettingsError) as raised:
        RunSettings.from_run_config({**RUN, "algorithm": "ditto", "lam": 0.5, "personal-steps": 0})
    assert str(raised.value) == "run config: ditto: personal_steps must be positive. Found 0."


def test_the_app_declares_every_option_of_every_algorithm() -> None:
    """Flower accepts a run-config override only for a key the app declares: every algorithm's
    option keys are there, and the declared defaults build every algorithm but ifca_mrmtl (which
    must be told when its warm start ends)."""
    import tomllib

    from dpledger.flower import family
    from dpledger.trainer.federated import registry

    app = Path(family.__file__).parent / "app" / "pyproject.toml"
    declared = tomllib.loads(app.read_text())["tool"]["flwr"]["app"]["config"]
    for name, cls in registry.algorithms().items():
        assert set(family.option_keys(cls)) <= set(declared), name
        if name != "ifca_mrmtl":
            RunSettings.from_run_config({**declared, "algorithm": name, "coordinator-key-file": "/c"})
