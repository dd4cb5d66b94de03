"""Personalized-Private-SGD (PPSGD) with client sampling, Bietti et al. 2022 Alg. 2, adapted to
silo-specific sample-level DP (Liu et al. 2022 Def. 3.1).

Model: additive, as in Bietti et al. 2022 eq. (3): silo k predicts with parameters w + θ_k (a global w and a
local θ_k). For the linear model this is exactly Bietti et al. 2022's f(x) = (w + θ_k)ᵀx; for the MLP it is
the same additive split applied to every weight.

Privacy unit, and why it differs from Bietti et al. 2022. Bietti et al. 2022 protects a *user* in the billboard model
and proves joint DP (its Thm. 4.1/5.1): only the aggregate of clipped per-user global gradients is
noised, and θ_i is computed from user i's raw data, unnoised, because under JDP user i's own output
need not be private towards user i. Here a silo is Bietti et al. 2022's "user", but what must be private is
each *record* of silo k, in every output silo k deploys (Liu et al. 2022 Def. 3.1) — and the deployed
model w + θ_k contains θ_k. Bietti et al. 2022's JDP argument therefore does not cover θ_k, and its per-user
clipping of a minibatch sum gives no per-record sensitivity either. We instead:

- clip each record's gradient to C and add N(0, σ²C²) per silo, on a Poisson batch of rate
  q_k = B_k/n_k: one sampled Gaussian query per step, declared as dpsgd(q_k, σ, E);
- use that single noisy gradient ĝ_k for both updates. In the additive model ∇_θ loss = ∇_w loss
  at the same point (both equal the gradient at w + θ_k), so θ_k ← θ_k − η ĝ_k and the message
  ĝ_k sent to the server are post-processing of the same query and cost nothing more;
- noise per silo rather than once at the server (Bietti et al. 2022 Alg. 2 line 12), since in the
  cross-silo model no silo trusts the server (Liu et al. 2022 §3, point 2).

The declared mechanism is then an honest upper bound on silo k's sample-level cost for everything
it releases and deploys. Client sampling (Alg. 2 line 4) is a public coin per round: a sampled silo
is charged its whole round, an unsampled one runs and declares nothing. No amplification by client
sampling is claimed, because the silo and the server both know whether it took part.
"""

from __future__ import annotations

import math

import torch

from dpledger.trainer.federated.base import FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import STREAM_CLIENTS, DPSGDConfig, derive_seed, make_generator
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.halves import Arrays, Halves, ServerHalf, ServerStart, SiloHalf, Trained

GLOBAL, LOCAL, STEP = "global", "local", "step"


class AdditiveSilo(SiloHalf):
    """E iterations of θ_k ← θ_k − η ĝ_k, each ĝ_k one noisy clipped gradient at w + θ_k (w as
    received); sends η Σ_t ĝ_t, the same queries' sum (post-processing)."""

    def start(self, initial: torch.Tensor, rows: int) -> Arrays:
        # θ_k starts at 0, so every silo's initial deployed model is the one the other algorithms start from.
        return {LOCAL: torch.zeros(rows, initial.shape[0], dtype=initial.dtype, device=initial.device)}

    def train(self, round_index: int, engine: SiloEngine, rows: torch.Tensor, received: Arrays,
              state: Arrays) -> Trained:
        lr = self.config.lr
        w = received[GLOBAL].unsqueeze(0)
        moved = torch.zeros(len(rows), w.shape[1], dtype=w.dtype, device=w.device)
        for _ in range(self.config.local_steps):
            theta = state[LOCAL][rows]
            noisy = engine.dp_gradient(w + theta, rows)
            state[LOCAL][rows] = theta - lr * noisy
            moved = moved + lr * noisy
        # θ_k moved by exactly −η Σ_t ĝ_t this round, and η Σ_t ĝ_t is also the message it sends.
        return Trained({STEP: moved}, update_norms(moved))

    def deployed(self, received: Arrays, state: Arrays) -> torch.Tensor:
        return received[GLOBAL].unsqueeze(0) + state[LOCAL]


class SampledServer(ServerHalf):
    """w ← w − α · mean_k (η Σ_t ĝ_k,t) over the round's participants, who are drawn with
    probability p per round by a public coin."""

    def __init__(self, start: ServerStart, *, alpha: float, client_rate: float, seed: int) -> None:
        super().__init__(start)
        self.alpha = alpha
        self.client_rate = client_rate
        self.seed = seed
        self.global_model = start.initial.clone()

    def asks(self, round_index: int) -> torch.Tensor:
        # A pure function of the seed and the round (drawn on CPU, so the same on every device).
        generator = make_generator(derive_seed(self.seed, STREAM_CLIENTS, round_index), torch.device("cpu"))
        return torch.rand(self.num_silos, generator=generator) < self.client_rate

    def broadcast(self, round_index: int) -> Arrays:
        return {GLOBAL: self.global_model}

    def aggregate(self, round_index: int, members: torch.Tensor, upload: Arrays) -> None:
        self.global_model = self.global_model - self.alpha * upload[STEP].mean(0)

    def state(self) -> Arrays:
        return {GLOBAL: self.global_model.clone()}


class PPSGD(FederatedAlgorithm):
    """Each round: silos are sampled with probability `client_rate` (p); each sampled and approved
    silo runs E = `config.local_steps` iterations θ_k ← θ_k − η ĝ_k at w + θ_k, then the server
    moves w by −αη times the mean of the participants' summed gradients (Bietti et al. 2022 Alg. 2
    with E local iterations per communication round; E = 1 is Alg. 2's synchronous step).

    α is the global/local step ratio (Bietti et al. 2022 §4): α = 0 is local learning (w never moves), large
    α moves the shared component faster. w starts at the template's initial model rather than 0
    (Alg. 2 line 2) because an all-zero MLP has no gradient signal to break symmetry.
    """

    name = "ppsgd"
    cost = "dpsgd(B_k/n_k, σ, E) if sampled, else None"
    deploys = "w + θ_k"

    @classmethod
    def halves(cls, config: DPSGDConfig, *, alpha: float, client_rate: float = 1.0) -> Halves:
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0. Found {alpha}.")
        if not 0 < client_rate <= 1:
            raise ValueError(f"client_rate must be in (0, 1]. Found {client_rate}.")
        return Halves(AdditiveSilo(config),
                      lambda start: SampledServer(start, alpha=alpha, client_rate=client_rate, seed=config.seed))
