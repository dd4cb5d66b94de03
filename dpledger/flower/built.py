"""A silo's data, and its algorithm's halves, model and engine, built once per run in a ClientApp process.

Every train message needs them twice, in the ledger gate (what the round will query) and in the
ClientApp (the training), and evaluate messages need the data and halves again. Built per call,
each would read the data file and build the halves anew; here each is built on first use and kept,
keyed by the run, the node and what it was built from (the data file; the message's public settings
but its round, and the silo's σ), so a later message of the same run reuses it.

How long that lasts is Flower's: its simulation engine keeps a ClientApp's process (a Ray actor)
for the whole run, so there the data is read and the halves built once per run, whatever the number
of rounds; a SuperNode in its subprocess isolation, as the README and the consortium's guide run it,
starts a fresh `flwr-clientapp` process for every message (Flower 1.41: no warm ClientApp exists for
that executor), so there the gate and the ClientApp share one load per round and nothing outlives
the message. Only the current run is kept: the first message of another run drops the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flwr.app import Context

from dpledger.flower import family
from dpledger.flower.local import SiloData, load_silo_file


class PerRun:
    """What this process built for its current run, by node."""

    def __init__(self) -> None:
        self._run: int | None = None
        self._data: dict[tuple[int, Path], SiloData] = {}
        self._parts: dict[tuple[int, Path, str, float], family.SiloParts] = {}

    def _enter(self, context: Context) -> None:
        if context.run_id != self._run:
            self._run, self._data, self._parts = context.run_id, {}, {}

    def data(self, context: Context, path: Path) -> SiloData:
        """The node's data file, read on first use in this run."""
        self._enter(context)
        key = (context.node_id, path)
        if key not in self._data:
            self._data[key] = load_silo_file(path)
        return self._data[key]

    def parts(self, context: Context, path: Path, config: Mapping[str, object], *,
              noise_multiplier: float) -> family.SiloParts:
        """The node's halves, model and engine for the settings of `config` (its round aside), built on first use."""
        data = self.data(context, path)
        settings = repr(sorted((key, value) for key, value in config.items() if key != "round"))
        key = (context.node_id, path, settings, noise_multiplier)
        if key not in self._parts:
            self._parts[key] = family.silo_parts(config, data, noise_multiplier=noise_multiplier)
        return self._parts[key]


per_run = PerRun()
