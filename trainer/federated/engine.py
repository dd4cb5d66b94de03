"""The DP queries a silo half may make of its silos' data, batched over silos (`SiloEngine`).

Every query of a silo's data goes through here and is counted in the engine's `QueryMeter` where
it is made: a DP-SGD step (a Poisson-sampled Gaussian of the clipped per-record gradients), or
IFCA's private cluster selection. The gradient is always the silo library's engine
(`dpledger.trainer.silo.dpsgd`): the simulator builds one engine over all its silos with seeded
random streams, which takes its steps with that engine's batched form; a Flower ClientApp builds
one over its own silo with fresh OS randomness (so the server can never predict a silo's batches or
noise), which takes each step with the engine's own one-silo step (`FlatStep`), the one benchmarked
against Opacus.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch
from torch.func import vmap

from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.federated.models import FlatModel
from dpledger.trainer.federated.padded import PaddedSilos
from dpledger.trainer.federated.plan import SELECTIONS, STEPS, Mechanism, QueryMeter
from dpledger.trainer.federated.selection import ClusterSelection
from dpledger.trainer.silo.dpsgd.batched import gaussian_noise, noisy_clipped_gradient, pad_batches
from dpledger.trainer.silo.dpsgd.clip import clip_factors
from dpledger.trainer.silo.dpsgd.flat import FlatStep
from dpledger.trainer.silo.dpsgd.sampler import PoissonSampler

# Random streams a silo draws from, by name (the simulator derives each from the run's seed).
SAMPLER, NOISE, SELECTION_SAMPLER, SELECTION_NOISE = "sampler", "noise", "selection sampler", "selection noise"
Streams = Callable[[str, int], torch.Generator]  # (stream, row) → that row's generator of that stream


def fresh_streams(device: torch.device) -> Streams:
    """Generators seeded from OS randomness (a silo's own process): nothing the server sent predicts them."""
    return lambda stream, row: torch.Generator(device=device).manual_seed(secrets.randbits(63))


class SiloEngine:
    """DP-SGD and private selection over the silos of `train` (rows 0..K−1), each with its own
    sampler (q_k = B_k / n_k), noise multiplier and random streams.

    `one_step_per_silo`: each row's gradient is the engine's one-silo step over the model's module
    (a Flower silo, whose one row is all it trains), rather than one batched computation over the
    rows (the simulator, whose seeded runs it keeps bit for bit)."""

    def __init__(self, *, train: PaddedSilos, model: FlatModel, config: DPSGDConfig,
                 noise_multipliers: list[float], streams: Streams, device: torch.device,
                 one_step_per_silo: bool = False) -> None:
        self.train = train
        self.model = model
        self.config = config
        self.device = device
        self.streams = streams
        self.noise_multipliers = noise_multipliers
        self._noise = torch.tensor(noise_multipliers, dtype=torch.float32, device=device)
        # A silo smaller than B samples every record (q = 1): honest, just no amplification.
        self.batch_sizes = [min(config.batch_size, n) for n in train.sizes]
        self._expected_batch = torch.tensor(self.batch_sizes, dtype=torch.float32, device=device)
        self.samplers = [PoissonSampler(dataset_size=n, batch_size=b, generator=streams(SAMPLER, k))
                         for k, (n, b) in enumerate(zip(train.sizes, self.batch_sizes, strict=True))]
        self.noise_generators = [streams(NOISE, k) for k in range(train.num_silos)]
        self._selection: tuple[ClusterSelection, list[PoissonSampler], list[torch.Generator]] | None = None
        self.meter = QueryMeter(train.num_silos)
        self.step = FlatStep(model.module, model.per_example_loss) if one_step_per_silo else None

    @property
    def num_silos(self) -> int:
        return self.train.num_silos

    def mechanism(self, row: int, *, steps: int) -> Mechanism:
        """`steps` DP-SGD steps of row `row`, as the sampler that runs them declares them."""
        return self.samplers[row].dpsgd(noise_multiplier=self.noise_multipliers[row], steps=steps)

    def dp_gradient(self, params: torch.Tensor, rows: torch.Tensor, *, noised: bool = True,
                    kind: str = STEPS) -> torch.Tensor:
        """One noisy clipped gradient per row in `rows` at its parameters `params` ([A, P]): one
        Poisson-sampled Gaussian query of each of those silos' data, metered as `kind`. `noised=False`
        clips without noise: only for an algorithm whose server noises the aggregate (PMTL), whose
        silos are charged that noise instead."""
        row_list = rows.tolist()
        batches = [self.samplers[k].sample() for k in row_list]
        self.meter.record(kind, rows)
        if self.step is not None:
            return torch.stack([
                self.step.gradient(params[a], self.train.x[k, batch], self.train.y[k, batch],
                                   max_grad_norm=self.config.clip_norm,
                                   noise_multiplier=self.noise_multipliers[k] if noised else 0.0,
                                   expected_batch_size=float(self.batch_sizes[k]), generator=self.noise_generators[k])
                for a, (k, batch) in enumerate(zip(row_list, batches, strict=True))
            ])
        idx, mask = pad_batches(batches, device=self.device)
        at = rows.unsqueeze(1)
        return noisy_clipped_gradient(
            self.model, params, self.train.x[at, idx], self.train.y[at, idx], mask,
            clip_norm=self.config.clip_norm, noise_multipliers=self._noise[rows] if noised else 0.0,
            expected_batch_sizes=self._expected_batch[rows], generators=[self.noise_generators[k] for k in row_list],
        )

    def dp_sgd(self, params: torch.Tensor, rows: torch.Tensor, *, steps: int, anchor: torch.Tensor | None = None,
               lam: float = 0.0, noised: bool = True, kind: str = STEPS) -> torch.Tensor:
        """`steps` DP-SGD steps from `params` ([A, P]); with an anchor, the objective gains
        λ/2‖w − anchor‖² (Liu et al. 2022 §5 / Alg. A1; Ditto's personal objective, Liu et al. 2022 §4).

        The regulariser's gradient λ(w − anchor) is not a function of the data beyond already-private
        quantities, so it is added after clipping and noise (post-processing) and costs nothing."""
        for _ in range(steps):
            update = self.dp_gradient(params, rows, noised=noised, kind=kind)
            # Skipped at λ = 0 rather than adding 0·(w − anchor): adding +0.0 turns -0.0 into +0.0,
            # and λ = 0 must reproduce local training bit for bit.
            if anchor is not None and lam != 0.0:
                update = update + lam * (params - anchor)
            params = params - self.config.lr * update
        return params

    # ----- IFCA's private cluster selection (trainer.federated.ifca explains the mechanism) -------

    def _selection_parts(self, selection: ClusterSelection) -> tuple[list[PoissonSampler], list[torch.Generator]]:
        if self._selection is None or self._selection[0] != selection:
            samplers = [
                PoissonSampler(dataset_size=n, batch_size=n if selection.batch_size is None else min(selection.batch_size, n),
                               generator=self.streams(SELECTION_SAMPLER, k))
                for k, n in enumerate(self.train.sizes)
            ]
            self._selection = (selection, samplers, [self.streams(SELECTION_NOISE, k) for k in range(self.num_silos)])
        return self._selection[1], self._selection[2]

    def selection_mechanism(self, row: int, selection: ClusterSelection) -> Mechanism:
        """The selection of row `row` as a ledger mechanism: one Poisson-sampled Gaussian."""
        samplers, _ = self._selection_parts(selection)
        return samplers[row].dpsgd(noise_multiplier=selection.noise_multiplier, steps=1)

    def select(self, models: torch.Tensor, rows: torch.Tensor, selection: ClusterSelection) -> torch.Tensor:
        """Each row's privately selected model of `models` ([k, P]) (int64 [A]); one selection query per row."""
        samplers, generators = self._selection_parts(selection)
        row_list = rows.tolist()
        idx, mask = pad_batches([samplers[k].sample() for k in row_list], device=self.device)
        self.meter.record(SELECTIONS, rows)
        at = rows.unsqueeze(1)
        x, y = self.train.x[at, idx], self.train.y[at, idx]
        per_record = vmap(self.model.example_loss, in_dims=(None, 0, 0))  # over records → [b]
        per_cluster = vmap(per_record, in_dims=(0, None, None))  # over cluster models → [k, b]
        with torch.no_grad():
            losses = vmap(per_cluster, in_dims=(None, 0, 0))(models, x, y).transpose(1, 2)  # [A, b, k]
            clip = selection.loss_clip
            factors = torch.where(mask, clip_factors(torch.linalg.vector_norm(losses, dim=-1), max_grad_norm=clip), 0.0)
            sums = torch.einsum("abk,ab->ak", losses, factors)
            noise = gaussian_noise([generators[k] for k in row_list], size=models.shape[0], std=1.0, device=self.device)
            return torch.argmin(sums + noise * (selection.noise_multiplier * clip), dim=1)
