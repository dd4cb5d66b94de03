"""Private multi-task learning (PMTL; Hu et al., "Private Multi-Task Learning", Alg. 1) with every
silo of the job counted in the server's average (no client sampling).

Each silo keeps a personal model, pulled towards the server's mean w̄ with weight λ, and trains it
with clipped gradients and no noise of its own; the trusted server adds the noise:
w̄ ← w̄ + (Σ_{k trained} clip_γ(w_k − w̄) + N(0, z²γ²I)) / K, K the number of silos in the job (a fixed
count, so one silo's update moves the sum by at most γ whatever the others answer). For one record of
a silo (the ledger's sample-level relation) the clipped update can move anywhere in the γ-ball, by
up to 2γ: the round is the Gaussian mechanism with multiplier z/2 (`record_level_mechanism`), the safe
side of the client-level z, and that is what each silo that trains is charged. The in-process
research copy (`research/pmtl.py`) adds Poisson sampling of silos, whose amplification the ledger
cannot check.
"""

from __future__ import annotations

import math

import torch

from dpledger.trainer.aggregation.clipping import clip_updates
from dpledger.trainer.federated.base import FederatedAlgorithm
from dpledger.trainer.federated.config import DPSGDConfig, check_lam
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerStart, Trained
from dpledger.trainer.federated.local import PERSONAL, train_personal
from dpledger.trainer.federated.mrmtl import MEAN, MODEL, MeanServer, PulledSilo
from dpledger.trainer.federated.plan import PlannedQuery
from dpledger.wire.mechanisms import Gaussian

# The silo's clipped, unnoised steps: covered by the server's Gaussian, which is what is charged.
SERVER_NOISED_STEPS = "server-noised steps"


def record_level_mechanism(*, server_noise: float) -> Gaussian:
    """What each silo that trains in a PMTL round is charged: the Gaussian of multiplier z/2."""
    if not (math.isfinite(server_noise) and server_noise > 0):
        raise ValueError(f"server_noise must be finite and > 0. Found {server_noise}.")
    return Gaussian(noise_multiplier=server_noise / 2.0)


def server_step(
    mean: torch.Tensor, models: torch.Tensor, trained: torch.Tensor, *, update_clip: float, server_noise: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The next mean [P] from the silos' models [K, P] (rows where `trained` is false are not read).
    The noise is drawn whatever answered, so the output is the charged mechanism's in every case."""
    if models.ndim != 2 or models.shape[1:] != mean.shape or trained.shape != (models.shape[0],) or trained.dtype != torch.bool:
        raise ValueError(f"models must be [K, {mean.shape[0]}] with a bool mask [K]. Found {tuple(models.shape)}, "
                         f"{tuple(trained.shape)} {trained.dtype}.")
    if not (math.isfinite(server_noise) and server_noise > 0):
        raise ValueError(f"server_noise must be finite and > 0. Found {server_noise}.")
    updates = torch.where(trained.unsqueeze(1), models - mean, torch.zeros((), dtype=mean.dtype))
    total = clip_updates(updates, clip_norm=update_clip).sum(0)
    noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + (total + noise * (server_noise * update_clip)) / models.shape[0]


class ServerNoisedSilo(PulledSilo):
    """MR-MTL's pulled personal model, trained with clipped gradients and no noise of its own; its
    round is charged the server's Gaussian at record level."""

    def __init__(self, config: DPSGDConfig, *, lam: float, server_noise: float) -> None:
        super().__init__(config, lam=lam)
        self.mechanism = record_level_mechanism(server_noise=server_noise)

    def queries(self, round_index: int, engine: SiloEngine, row: int) -> tuple[PlannedQuery, ...]:
        return (PlannedQuery(SERVER_NOISED_STEPS, self.config.local_steps, self.mechanism),)

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        norms = train_personal(engine, state, rows, steps=self.config.local_steps, anchor=received[MEAN],
                               lam=self.lam, noised=False, kind=SERVER_NOISED_STEPS)
        return Trained({MODEL: state[PERSONAL][rows]}, norms)


class NoisingServer(MeanServer):
    """Hu et al. Alg. 1 line 8: clip each trained silo's update from w̄, sum, add N(0, z²γ²), divide by K."""

    def __init__(self, start: ServerStart, *, server_noise: float, update_clip: float) -> None:
        super().__init__(start)
        self.server_noise = server_noise
        self.update_clip = update_clip
        self.generator = start.noise

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        models = torch.zeros_like(self.latest)
        models[members] = upload[MODEL]
        trained = torch.zeros(self.num_silos, dtype=torch.bool)
        trained[members.cpu()] = True
        self.mean = server_step(self.mean, models, trained.to(models.device), update_clip=self.update_clip,
                                server_noise=self.server_noise, generator=self.generator)


class PMTL(FederatedAlgorithm):
    """Personal models pulled towards a mean that the server releases with Gaussian noise of
    multiplier z = `server_noise` on the sum of updates clipped to γ = `update_clip`.

    Cost per round: gaussian(z/2) for each silo that trains (see the module docstring); its local
    steps add nothing, their clipped gradients reach the world only through the noised mean.
    """

    name = "pmtl"
    cost = "gaussian(z/2), z the server's noise multiplier"
    deploys = "own model, pulled to the noised mean"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, lam: float, server_noise: float = 1.0, update_clip: float = 1.0) -> Halves:
        check_lam(lam)
        if not (math.isfinite(update_clip) and update_clip > 0):
            raise ValueError(f"update_clip must be finite and > 0. Found {update_clip}.")
        return Halves(ServerNoisedSilo(config, lam=lam, server_noise=server_noise),
                      lambda start: NoisingServer(start, server_noise=server_noise, update_clip=update_clip))
