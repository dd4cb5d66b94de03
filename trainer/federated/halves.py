"""Every federated algorithm, written once as a silo half and a server half.

The silo half is what a silo runs on its own data and keeps to itself: its local training, its
personal state, and what it sends the server (`SiloHalf.train`). The server half is what the server
sends every silo each round and how it folds the silos' uploads into its own state
(`ServerHalf.broadcast`, `ServerHalf.aggregate`). Neither half sees a budget.

The same halves run everywhere: the in-process simulator (`FederatedAlgorithm`) drives them over
all its silos at once (a silo half is batched over the rows it is given), the Flower ClientApp runs
the silo half over its one silo behind the ledger gate, and the Flower ServerApp's strategy wraps
the server half. So an algorithm is defined in one class, and what it charges (`SiloHalf.queries`)
is the same wherever it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.plan import STEPS, Mechanism, PlannedQuery

Arrays = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Trained:
    """What a silo half's round produced for the rows it trained: `upload` (each value [A, ...]),
    what the silos send the server; `norms` [A], the L2 norm of each one's noisy update, which a
    silo reports to the ledger with its own key (never to the server)."""

    upload: Arrays
    norms: torch.Tensor


class SiloHalf(ABC):
    """A silo's side of an algorithm, batched over the rows (silos) it is given: every simulated
    silo in the simulator, the one silo of a Flower ClientApp. `state` holds per-silo tensors with
    a leading row dimension; a row that is not trained is left bitwise unchanged."""

    def __init__(self, config: DPSGDConfig) -> None:
        self.config = config

    def steps(self, round_index: int) -> int:
        """DP-SGD steps an asked silo runs in round `round_index` (E by default). A pure function of
        the round, so what is declared and what runs agree."""
        return self.config.local_steps

    def extra_queries(self, round_index: int, engine: SiloEngine, row: int) -> tuple[PlannedQuery, ...]:
        """Queries of row `row`'s data besides its DP-SGD steps in round `round_index` (none by default)."""
        return ()

    def queries(self, round_index: int, engine: SiloEngine, row: int) -> tuple[PlannedQuery, ...]:
        """Every query an asked silo's round makes of its data: what it asks the ledger to approve."""
        steps = self.steps(round_index)
        dpsgd = PlannedQuery(STEPS, steps, engine.mechanism(row, steps=steps))
        return (dpsgd, *self.extra_queries(round_index, engine, row))

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        """The personal state of `rows` silos before round 0 (none by default)."""
        return {}

    @abstractmethod
    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        """Round `round_index` for the approved rows `rows` (int64 [A]), given what the server broadcast."""

    @abstractmethod
    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        """[rows, P]: the model each silo deploys, given the server's current broadcast."""


@dataclass(frozen=True)
class ServerStart:
    """What a server half starts from: the initial model every silo shares, the number of silos in
    the job, a fresh initial model per index (IFCA's extra cluster models), the server's own noise
generator, and `record`, through
    which a server that runs a query on the silos' data (FedHDP's quantile query) reports it: the
    simulator meters it against what each silo was charged; over Flower the silo's gate charged it."""

    initial: torch.Tensor
    num_silos: int
    fresh_model: Callable[[int], torch.Tensor]
    record: Callable[[str, torch.Tensor, Mechanism], None]
    noise: torch.Generator  # the server's own noise (PMTL's): seeded in the simulator, OS randomness over Flower


class ServerHalf(ABC):
    """The server's side of an algorithm: its own state, what it broadcasts, how it aggregates.
    Silos are named by their position 0..K−1 in the job."""

    def __init__(self, start: ServerStart) -> None:
        self.num_silos = start.num_silos

    def asks(self, round_index: int) -> torch.Tensor:
        """bool [K]: the silos round `round_index` asks to train (all by default). A public coin:
        a pure function of the round and the run's seed."""
        return torch.ones(self.num_silos, dtype=torch.bool)

    @abstractmethod
    def broadcast(self, round_index: int) -> Arrays:
        """What every asked silo receives at the start of round `round_index`; a pure function of the
        server's state (the last round's broadcast is also what silos deploy against)."""

    @abstractmethod
    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        """Fold the uploads of the silos `members` (int64 [A], positions) that trained this round."""

    @abstractmethod
    def state(self) -> Arrays:
        """Copies of the server's state."""


@dataclass(frozen=True)
class Halves:
    """An algorithm: its silo half, and how to start its server half."""

    silo: SiloHalf
    server: Callable[[ServerStart], ServerHalf]
