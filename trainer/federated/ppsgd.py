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
from typing import Unpack

import torch

from dpledger.trainer.federated.base import AlgorithmArgs, FederatedAlgorithm, update_norms
from dpledger.trainer.federated.config import (
    STREAM_CLIENTS,
    derive_seed,
    make_generator,
)


class PPSGD(FederatedAlgorithm):
    """Each round: silos are sampled with probability `client_rate` (p); each sampled and
    approved silo runs E = `config.local_steps` synchronous iterations of Bietti et al. 2022 Alg. 2:
    θ_k ← θ_k − η ĝ_k, then the server sets w ← w − αη · mean_k ĝ_k over the participants.

    α is the global/local step ratio (Bietti et al. 2022 §4): α = 0 is local learning (w never moves), large
    α moves the shared component faster. w starts at the template's initial model rather than 0
    (Alg. 2 line 2) because an all-zero MLP has no gradient signal to break symmetry; θ_k starts
    at 0, so every silo's initial deployed model is the same as in the other algorithms.
    """

    name = "ppsgd"
    cost = "dpsgd(B_k/n_k, σ, E) if sampled, else None"
    deploys = "w + θ_k"

    def __init__(
        self,
        *,
        alpha: float,
        client_rate: float = 1.0,
        **common: Unpack[AlgorithmArgs],
    ) -> None:
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0. Found {alpha}.")
        if not 0 < client_rate <= 1:
            raise ValueError(f"client_rate must be in (0, 1]. Found {client_rate}.")
        super().__init__(**common)
        self.alpha = alpha
        self.client_rate = client_rate
        self.global_model = self.initial.clone()
        self.local = torch.zeros(self.num_silos, self.model.size, dtype=self.initial.dtype, device=self.device)

    def sampled(self, round_index: int) -> torch.Tensor:
        """bool [K]: which silos round `round_index` samples. A pure function of the seed and the
        round (drawn on CPU, so the same on every device), so the silos that declared a mechanism are
        exactly those that may run."""
        generator = make_generator(derive_seed(self.config.seed, STREAM_CLIENTS, round_index), torch.device("cpu"))
        return torch.rand(self.num_silos, generator=generator) < self.client_rate

    def declared_steps(self, round_index: int) -> list[int]:
        return [self.config.local_steps if s else 0 for s in self.sampled(round_index).tolist()]

    def _train(self, round_index: int, silos: torch.Tensor) -> torch.Tensor:
        lr = self.config.lr
        moved = torch.zeros(len(silos), self.model.size, dtype=self.initial.dtype, device=self.device)
        for _ in range(self.config.local_steps):
            theta = self.local[silos]
            noisy = self._dp_gradient(self.global_model.unsqueeze(0) + theta, silos)
            self.local[silos] = theta - lr * noisy
            self.global_model = self.global_model - self.alpha * lr * noisy.mean(0)
            moved = moved + lr * noisy
        # θ_k moved by exactly −η Σ_t ĝ_t this round, and ĝ_t is also the message it sent.
        return update_norms(moved)

    def deployed_parameters(self) -> torch.Tensor:
        return self.global_model.unsqueeze(0) + self.local

    def state(self) -> dict[str, torch.Tensor]:
        return {"global": self.global_model.clone(), "local": self.local.clone()}
