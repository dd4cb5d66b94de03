"""The interface every federated algorithm offers the round loop, and the batched DP-SGD they share.

Round protocol (docs/ARCHITECTURE.md, "The round protocol"): the loop asks `round_mechanisms(r)`, gets each
silo's mechanism approved (or not) by the ledger, then calls `run_round(r, approved)`. Only approved
silos touch their data; the others' state stays bitwise unchanged. Privacy model: Liu et al. 2022 Def. 3.1
(silo-specific sample-level DP); only dataset queries cost (Liu et al. 2022 §3), so what each algorithm
declares is exactly its number of DP-SGD steps on the silo's data in that round.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, TypedDict

import torch
from torch.func import vmap

from dpledger.trainer.dpsgd.sampler import PoissonSampler
from dpledger.trainer.federated.batched import (
    PaddedSilos,
    noisy_clipped_gradient,
    pad_batches,
)
from dpledger.trainer.federated.config import (
    STREAM_INIT,
    STREAM_NOISE,
    STREAM_SAMPLER,
    DPSGDConfig,
    RoundResult,
    Task,
    Weighting,
    derive_seed,
    make_generator,
)
from dpledger.trainer.federated.models import Architecture, ModelFactory, make_template
from dpledger.trainer.federated.plan import STEPS, PlannedQuery, QueryMeter, RoundPlan

# Every algorithm class that sets `name`, by that name (filled by FederatedAlgorithm.__init_subclass__).
REGISTERED: dict[str, type[FederatedAlgorithm]] = {}


class _RequiredArgs(TypedDict):
    x_train: Sequence[torch.Tensor]
    y_train: Sequence[torch.Tensor]
    x_test: Sequence[torch.Tensor]
    y_test: Sequence[torch.Tensor]


class AlgorithmArgs(_RequiredArgs, total=False):
    """The constructor arguments every algorithm shares (subclasses take `**common: Unpack[...]`)."""

    model: ModelFactory | Architecture
    task: Task
    num_classes: int | None
    config: DPSGDConfig
    noise_multipliers: Sequence[float] | None
    device: torch.device | str


def update_norms(updates: torch.Tensor) -> torch.Tensor:
    """[A] L2 norm of each row of [A, P] updates (what a round reports to the coordinator)."""
    norms: torch.Tensor = torch.linalg.vector_norm(updates, dim=1)  # torch.linalg is unannotated
    return norms


class FederatedAlgorithm(ABC):
    """K silos trained in one batched computation; state lives in [K, P] / [P] tensors."""

    # A concrete algorithm names itself (its key in trainer.federated.registry and in job files) and
    # says in words what one round charges each silo, and which model each silo deploys (the docs).
    name: ClassVar[str]
    cost: ClassVar[str]
    deploys: ClassVar[str]
    # True for an algorithm that needs a coordinator between rounds (the privacy groups of
    # trainer.grouped), so that a plain round loop cannot run it alone.
    coordinated: ClassVar[bool] = False

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
    ) -> None:
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
        self.model = make_template(
            model,
            task=task,
            in_features=int(x_train[0].shape[1]),
            out_features=out_features,
            init_seed=derive_seed(config.seed, STREAM_INIT),
            device=self.device,
        )
        # Every silo starts from the same initial model (as in FedAvg), so that algorithms differ only
        # in how they train and aggregate, and λ = 0 MR-MTL coincides with local training exactly.
        self.initial = self.model.initial()
        # A silo smaller than B samples every record (q = 1): honest, just no amplification.
        self.batch_sizes = [min(config.batch_size, n) for n in self.train.sizes]
        self.samplers = [
            PoissonSampler(
                dataset_size=n,
                batch_size=b,
                generator=make_generator(derive_seed(config.seed, STREAM_SAMPLER, k), self.device),
            )
            for k, (n, b) in enumerate(zip(self.train.sizes, self.batch_sizes, strict=True))
        ]
        self.noise_generators = [
            make_generator(derive_seed(config.seed, STREAM_NOISE, k), self.device) for k in range(self.num_silos)
        ]
        self._expected_batch = torch.tensor(self.batch_sizes, dtype=torch.float32, device=self.device)
        # Each silo may calibrate its own σ to its own budget (Liu et al. 2022 Def. 3.1: silo-specific
        # (ε_k, δ_k)); by default every silo uses config.noise_multiplier.
        if noise_multipliers is None:
            noise_multipliers = [config.noise_multiplier] * self.num_silos
        if len(noise_multipliers) != self.num_silos or not all(math.isfinite(s) and s >= 0 for s in noise_multipliers):
            raise ValueError(
                f"noise_multipliers must hold one finite σ >= 0 per silo ({self.num_silos}). Found {list(noise_multipliers)}."
            )
        self.noise_multipliers = [float(s) for s in noise_multipliers]
        self._noise = torch.tensor(self.noise_multipliers, dtype=torch.float32, device=self.device)
        self.meter = QueryMeter(self.num_silos)
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

    @property
    def num_silos(self) -> int:
        return self.train.num_silos

    @property
    def _queries(self) -> torch.Tensor:
        """int64 [K]: DP-SGD steps each silo has run on its data so far."""
        return self.meter.total(STEPS)

    # ----- what subclasses define -------------------------------------------------------------

    def declared_steps(self, round_index: int) -> list[int]:
        """Per silo: DP-SGD steps on its data that round `round_index` will run if approved (0: none).
        A pure function of the round index and the seed, so declaring and running agree. By default
        every silo runs E = `config.local_steps` steps every round."""
        return [self.config.local_steps] * self.num_silos

    def extra_queries(self, round_index: int, silo: int) -> tuple[PlannedQuery, ...]:
        """Queries of silo `silo`'s data that round `round_index` makes besides its DP-SGD steps, if it
        runs any (none by default). Pure, like `declared_steps`."""
        return ()

    @abstractmethod
    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        """Run the round for the silos in `silos` (int64 [A], on device), all approved; return the
        L2 norm of each one's noisy update ([A])."""

    @abstractmethod
    def deployed_parameters(self) -> torch.Tensor:
        """[K, P]: the model each silo would deploy."""

    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """Copies of all trained state: per-silo tensors have leading dim K, shared ones do not."""

    # ----- the round protocol -----------------------------------------------------------------

    def plan(self, round_index: int) -> RoundPlan:
        """Every query round `round_index` makes of each silo's data, computed once per round: the
        DP-SGD steps' mechanism comes from the silo's own sampler (the mechanism a worker declares is
        the sampler it runs), then the algorithm's extra queries."""
        if self._plan is None or self._plan.round_index != round_index:
            queries: list[tuple[PlannedQuery, ...]] = []
            steps = self.declared_steps(round_index)
            for k, (sampler, sigma, n) in enumerate(zip(self.samplers, self.noise_multipliers, steps, strict=True)):
                if n == 0:
                    queries.append(())
                    continue
                dpsgd = PlannedQuery(STEPS, n, sampler.mechanism(noise_multiplier=sigma, steps=n))
                queries.append((dpsgd, *self.extra_queries(round_index, k)))
            self._plan = RoundPlan(round_index=round_index, queries=tuple(queries))
        return self._plan

    def round_mechanisms(self, round_index: int) -> list[dict[str, Any] | None]:
        """Per silo, the mechanism its round `round_index` runs, or None where it queries nothing."""
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
        self._last_round = round_index
        plan = self.plan(round_index)
        active = approved.cpu() & plan.queries_data()
        norms = torch.full((self.num_silos,), float("nan"), dtype=torch.float64)
        self.meter.start()
        if bool(active.any()):
            silos = torch.nonzero(active).flatten()
            norms[silos] = self._train(round_index, silos.to(self.device)).detach().cpu().to(torch.float64)
        ran = self.meter.since_start()
        plan.check(active, ran)  # raises unless exactly the approved plan ran
        steps = ran.counts.get(STEPS, torch.zeros(self.num_silos, dtype=torch.int64))
        return RoundResult(round_index=round_index, update_norms=norms, steps=steps)

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

    # ----- shared DP-SGD machinery ------------------------------------------------------------

    def _dp_gradient(self, params: torch.Tensor, silos: torch.Tensor) -> torch.Tensor:
        """One noisy clipped gradient per silo in `silos` at its parameters `params` ([A, P]): one
        Poisson-sampled Gaussian query of each of those silos' data."""
        silo_list = silos.tolist()
        indices = [self.samplers[k].sample() for k in silo_list]
        idx, mask = pad_batches(indices, device=self.device)
        rows = silos.unsqueeze(1)
        self.meter.record(STEPS, silos)
        return noisy_clipped_gradient(
            self.model,
            params,
            self.train.x[rows, idx],
            self.train.y[rows, idx],
            mask,
            clip_norm=self.config.clip_norm,
            noise_multipliers=self._noise[silos],
            expected_batch_sizes=self._expected_batch[silos],
            generators=[self.noise_generators[k] for k in silo_list],
        )

    def _dp_sgd(
        self,
        params: torch.Tensor,
        silos: torch.Tensor,
        *,
        steps: int,
        anchor: torch.Tensor | None = None,
        lam: float = 0.0,
    ) -> torch.Tensor:
        """`steps` DP-SGD steps from `params` ([A, P]); with an anchor, the objective gains
        λ/2‖w − anchor‖² (Liu et al. 2022 §5 / Alg. A1; Ditto's personal objective, Liu et al. 2022 §4).

        The regulariser's gradient λ(w − anchor) is not a function of the data beyond already-private
        quantities, so it is added after clipping and noise (post-processing) and costs nothing."""
        for _ in range(steps):
            update = self._dp_gradient(params, silos)
            # Skipped at λ = 0 rather than adding 0·(w − anchor): adding +0.0 turns -0.0 into +0.0,
            # and λ = 0 must reproduce local training bit for bit.
            if anchor is not None and lam != 0.0:
                update = update + lam * (params - anchor)
            params = params - self.config.lr * update
        return params

    def _train_personal(
        self, personal: torch.Tensor, silos: torch.Tensor, *, anchor: torch.Tensor | None = None, lam: float = 0.0
    ) -> torch.Tensor:
        """E DP-SGD steps on each approved silo's own model (rows of `personal`, updated in place),
        pulled towards `anchor` with weight λ if given; returns the update norms."""
        start = personal[silos]
        trained = self._dp_sgd(start, silos, steps=self.config.local_steps, anchor=anchor, lam=lam)
        personal[silos] = trained
        return update_norms(trained - start)

    def _aggregate(self, models: torch.Tensor, silos: torch.Tensor, *, weighting: Weighting) -> torch.Tensor:
        """Server average of the participating silos' models ([A, P] → [P]); post-processing."""
        if weighting == "uniform":
            return models.mean(0)
        sizes = torch.tensor(self.train.sizes, dtype=models.dtype, device=models.device)[silos]
        return (models * (sizes / sizes.sum()).unsqueeze(1)).sum(0)
