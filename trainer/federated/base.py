"""The in-process simulator: K silos driven through one algorithm's two halves at once.

An algorithm is a silo half and a server half (`trainer.federated.halves`); `FederatedAlgorithm`
runs both over K silos whose parameters are stacked into [K, P] tensors, so one round trains every
approved silo in one batched computation. Round protocol (docs/ARCHITECTURE.md, "The round
protocol"): the loop asks `round_mechanisms(r)`, gets each silo's mechanism approved (or not) by
the ledger, then calls `run_round(r, approved)`. Only approved silos touch their data; the others'
state stays bitwise unchanged. Privacy model: Liu et al. 2022 Def. 3.1 (silo-specific sample-level
DP); only dataset queries cost (Liu et al. 2022 §3), so what each algorithm declares is exactly the
queries its silo half makes of the silo's data in that round.
"""

from __future__ import annotations

import functools
import math
from abc import ABC
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypedDict

import torch
from torch.func import vmap

from dpledger.trainer.federated import engine as streams
from dpledger.trainer.federated.config import (
    STREAM_INIT,
    STREAM_NOISE,
    STREAM_SAMPLER,
    DPSGDConfig,
    RoundResult,
    Task,
    derive_seed,
    make_generator,
)
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerHalf, ServerStart, SiloHalf
from dpledger.trainer.federated.models import Architecture, ModelFactory, make_template
from dpledger.trainer.federated.padded import PaddedSilos
from dpledger.trainer.federated.plan import STEPS, Mechanism, PlannedQuery, RoundPlan

# Every algorithm class that sets `name`, by that name (filled by FederatedAlgorithm.__init_subclass__).
REGISTERED: dict[str, type[FederatedAlgorithm]] = {}

# Random streams of IFCA's selection (0–4 are taken in trainer.federated.config and .fedhdp), so that
# enabling selection never shifts DP-SGD's draws.
STREAM_SELECTION_SAMPLER = 5
STREAM_SELECTION_NOISE = 6
STREAM_SERVER_NOISE = 7  # a server that noises what it releases (PMTL)
_STREAM_IDS = {streams.SAMPLER: STREAM_SAMPLER, streams.NOISE: STREAM_NOISE,
               streams.SELECTION_SAMPLER: STREAM_SELECTION_SAMPLER, streams.SELECTION_NOISE: STREAM_SELECTION_NOISE}


def seeded_stream(seed: int, device: torch.device, stream: str, k: int) -> torch.Generator:
    """Silo k's generator of `stream`, derived from the run's seed (the simulator's `Streams`)."""
    return make_generator(derive_seed(seed, _STREAM_IDS[stream], k), device)


class _RequiredArgs(TypedDict):
    x_train: Sequence[torch.Tensor]
    y_train: Sequence[torch.Tensor]
    x_test: Sequence[torch.Tensor]
    y_test: Sequence[torch.Tensor]


class AlgorithmArgs(_RequiredArgs, total=False):
    """The constructor arguments every algorithm shares; the rest are the algorithm's own options,
    the keyword arguments of its `halves`."""

    model: ModelFactory | Architecture
    task: Task
    num_classes: int | None
    config: DPSGDConfig
    noise_multipliers: Sequence[float] | None
    device: torch.device | str


def update_norms(updates: torch.Tensor) -> torch.Tensor:
    """[A] L2 norm of each row of [A, P] updates (what a round reports to the ledger)."""
    norms: torch.Tensor = torch.linalg.vector_norm(updates, dim=1)  # torch.linalg is unannotated
    return norms


class FederatedAlgorithm(ABC):
    """K silos trained in one batched computation through the algorithm's halves."""

    # A concrete algorithm names itself (its key in trainer.federated.registry, in job files and in
    # the Flower run config) and says in words what one round charges each silo, and which model each
    # silo deploys (the docs).
    name: ClassVar[str]
    cost: ClassVar[str]
    deploys: ClassVar[str]
    # True for an algorithm whose server needs the privacy groups the ledger finds from the
    # warm-start round's norms (trainer.grouped), so that a plain round loop cannot run it alone.
    coordinated: ClassVar[bool] = False

    # A concrete algorithm's classmethod `halves(config, **options)`: its silo half and server half
    # for the options given (its keyword arguments are the algorithm's own settings, checked there,
    # wherever it runs: the simulator, the job file, the Flower apps).
    halves: ClassVar[Callable[..., Halves]]

    def __init__(
        self,
        *,
        x_train: Sequence[torch.Tensor],
        y_train: Sequence[torch.Tensor],
        x_test: Sequence[torch.Tensor],
        y_test: Sequence[torch.Tensor],
        model: ModelFactory | Architecture = "mlp",
        task: Task = "classification",
        num_classes: int | None = None,
        config: DPSGDConfig = DPSGDConfig(),
        noise_multipliers: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
        **options: Any,
    ) -> None:
        halves = self.halves(config, **options)  # the options are checked before any data is touched
        if task not in ("classification", "regression"):
            raise ValueError(f"task must be 'classification' or 'regression'. Found {task!r}.")
        if len(x_test) != len(x_train) or len(y_test) != len(x_train):
            raise ValueError(
                f"Need train and test tensors for every silo. Found {len(x_train)} train, "
                f"{len(x_test)} x_test, {len(y_test)} y_test."
            )
        self.device = torch.device(device)
        self.config = config
        self.task: Task = task
        self.train = PaddedSilos.from_tensors(x_train, y_train, task=task, device=self.device, allow_empty=False)
        self.test = PaddedSilos.from_tensors(x_test, y_test, task=task, device=self.device, allow_empty=True)
        if task == "classification":
            labels = [y for y in [*y_train, *y_test] if y.numel() > 0]
            if any(y.is_floating_point() or y.is_complex() for y in labels):
                raise ValueError("Classification labels must be integer tensors.")
            if num_classes is None:
                num_classes = 1 + max(int(y.max().item()) for y in labels)
            if any(int(y.min().item()) < 0 or int(y.max().item()) >= num_classes for y in labels):
                raise ValueError(f"Classification labels must be in [0, num_classes={num_classes}).")
            out_features = num_classes
        else:
            out_features = 1
        in_features = int(x_train[0].shape[1])

        def template(init_seed: int) -> Any:
            return make_template(model, task=task, in_features=in_features, out_features=out_features,
                                 init_seed=init_seed, device=self.device)

        self.model = template(derive_seed(config.seed, STREAM_INIT))
        # Every silo starts from the same initial model (as in FedAvg), so that algorithms differ only
        # in how they train and aggregate, and λ = 0 MR-MTL coincides with local training exactly.
        self.initial = self.model.initial()
        # Each silo may calibrate its own σ to its own budget (Liu et al. 2022 Def. 3.1: silo-specific
        # (ε_k, δ_k)); by default every silo uses config.noise_multiplier.
        if noise_multipliers is None:
            noise_multipliers = [config.noise_multiplier] * self.train.num_silos
        count = self.train.num_silos
        if len(noise_multipliers) != count or not all(math.isfinite(s) and s >= 0 for s in noise_multipliers):
            raise ValueError(
                f"noise_multipliers must hold one finite σ >= 0 per silo ({count}). Found {list(noise_multipliers)}."
            )
        self.noise_multipliers = [float(s) for s in noise_multipliers]
        self.engine = SiloEngine(
            train=self.train, model=self.model, config=config, noise_multipliers=self.noise_multipliers,
            # A partial of a module function, not a lambda: a job's checkpoint pickles the algorithm whole.
            streams=functools.partial(seeded_stream, config.seed, self.device),
            device=self.device,
        )
        self.meter = self.engine.meter
        self.silo: SiloHalf = halves.silo
        self.silo_state: Arrays = self.silo.start(self.initial, self.num_silos)
        self.server: ServerHalf = halves.server(ServerStart(
            initial=self.initial, num_silos=self.num_silos,
            fresh_model=lambda j: template(derive_seed(config.seed, STREAM_INIT, j)).initial(),
            record=self._record_server_query,
            noise=make_generator(derive_seed(config.seed, STREAM_SERVER_NOISE), torch.device("cpu")),
        ))
        self._plan: RoundPlan | None = None
        self._last_round = -1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # An algorithm that names itself is registered under that name (trainer.federated.registry).
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None:
            if not ("cost" in cls.__dict__ and "deploys" in cls.__dict__):
                raise TypeError(f"algorithm {name!r} must say its per-round cost and what it deploys")
            if name in REGISTERED and REGISTERED[name] is not cls:
                raise TypeError(f"two algorithms named {name!r}: {REGISTERED[name].__qualname__} and {cls.__qualname__}")
            REGISTERED[name] = cls

    def _record_server_query(self, kind: str, silos: torch.Tensor, mechanism: Mechanism) -> None:
        self.meter.record(kind, silos, mechanism=mechanism)

    @property
    def num_silos(self) -> int:
        return self.train.num_silos

    @property
    def samplers(self) -> list[Any]:
        return self.engine.samplers

    @property
    def batch_sizes(self) -> list[int]:
        return self.engine.batch_sizes

    @property
    def _queries(self) -> torch.Tensor:
        """int64 [K]: DP-SGD steps each silo has run on its data so far."""
        return self.meter.total(STEPS)

    # ----- the round protocol -----------------------------------------------------------------

    def declared_steps(self, round_index: int) -> list[int]:
        """Per silo: DP-SGD steps on its data that round `round_index` will run if approved (0: the
        server does not ask it). A pure function of the round index and the seed."""
        asked = self.server.asks(round_index).tolist()
        return [self.silo.steps(round_index) if a else 0 for a in asked]

    def plan(self, round_index: int) -> RoundPlan:
        """Every query round `round_index` makes of each asked silo's data, computed once per round
        from the silo half (the DP-SGD steps' mechanism comes from the silo's own sampler)."""
        if self._plan is None or self._plan.round_index != round_index:
            asked = self.server.asks(round_index).tolist()
            queries: list[tuple[PlannedQuery, ...]] = [
                self.silo.queries(round_index, self.engine, k) if a else () for k, a in enumerate(asked)
            ]
            self._plan = RoundPlan(round_index=round_index, queries=tuple(queries))
        return self._plan

    def round_mechanisms(self, round_index: int) -> list[Mechanism | None]:
        """Per silo, the mechanism its round `round_index` runs (a `dpledger.wire` model), or None
        where it queries nothing."""
        return self.plan(round_index).mechanisms()

    def run_round(self, round_index: int, approved: torch.Tensor) -> RoundResult:
        """Run round `round_index` for the silos with `approved[k]` (bool [K]) and a declared
        mechanism; every other silo draws no batch and no noise, and its own state is left bitwise
        unchanged. Round indices must increase (a round cannot be replayed)."""
        if round_index <= self._last_round:
            raise ValueError(f"round_index must exceed the last round run ({self._last_round}). Found {round_index}.")
        if approved.dtype != torch.bool or tuple(approved.shape) != (self.num_silos,):
            raise ValueError(
                f"approved must be a bool tensor of shape ({self.num_silos},). "
                f"Found {approved.dtype} {tuple(approved.shape)}."
            )
        self._check_round(round_index)
        self._last_round = round_index
        plan = self.plan(round_index)
        active = approved.cpu() & plan.queries_data()
        norms = torch.full((self.num_silos,), float("nan"), dtype=torch.float64)
        self.meter.start()
        if bool(active.any()):
            silos = torch.nonzero(active).flatten().to(self.device)
            received = self.server.broadcast(round_index)
            trained = self.silo.train(round_index, self.engine, silos, received, self.silo_state)
            self.server.aggregate(round_index, silos, trained.upload)
            norms[silos.cpu()] = trained.norms.detach().cpu().to(torch.float64)
        ran = self.meter.since_start()
        plan.check(active, ran)  # raises unless exactly the approved plan ran
        zeros = torch.zeros(self.num_silos, dtype=torch.int64)
        steps = ran.counts.get(STEPS, zeros)
        queries = sum(ran.counts.values(), zeros)
        return RoundResult(round_index=round_index, update_norms=norms, steps=steps, queries=queries)

    def _check_round(self, round_index: int) -> None:
        """Raise before any silo touches its data if round `round_index` cannot run (none by default)."""
        return None

    def deployed_parameters(self) -> torch.Tensor:
        """[K, P]: the model each silo would deploy now."""
        return self.silo.deployed(self.server.broadcast(self._last_round + 1), self.silo_state)

    def state(self) -> dict[str, torch.Tensor]:
        """Copies of all trained state: the server's (shared) and every silo's (leading dim K)."""
        return {**self.server.state(), **{key: value.clone() for key, value in self.silo_state.items()}}

    def evaluate(self) -> torch.Tensor:
        """Per-silo test accuracy (classification) or mean squared error (regression) of the model
        each silo deploys, as a CPU float64 [K] tensor (nan for a silo without test records)."""
        with torch.no_grad():
            out = vmap(self.model.forward, in_dims=(0, 0))(self.deployed_parameters(), self.test.x)
            mask = self.test.mask
            if self.task == "classification":
                per_record = (out.argmax(-1) == self.test.y).to(torch.float64)
            else:
                per_record = (out.squeeze(-1) - self.test.y).to(torch.float64) ** 2
            totals = torch.where(mask, per_record, 0.0).sum(1)
            counts = mask.sum(1).to(torch.float64)
            return (totals / counts).cpu()  # 0/0 = nan for an empty test set, as documented
