"""Hyperparameters shared by every federated algorithm, and what a round reports back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import torch

Task = Literal["classification", "regression"]
# How the server averages silo models. Liu et al. 2022 §2 calls FedAvg's server step "a simple (weighted)
# average"; its analysis (§6) uses the uniform mean w̄ = (1/K) Σ_k w_k, which is also the mean the
# MR-MTL regulariser pulls towards (§5). "dataset_size" weights by n_k (McMahan et al. 2017); n_k is
# registered with the ledger and public to the federation, so using it costs no privacy.
Weighting = Literal["uniform", "dataset_size"]


def check_weighting(weighting: str) -> Weighting:
    if weighting in ("uniform", "dataset_size"):
        return cast(Weighting, weighting)
    raise ValueError(f"weighting must be 'uniform' or 'dataset_size'. Found {weighting!r}.")


def check_lam(lam: float) -> float:
    """λ of a pull towards a shared model (MR-MTL's, Ditto's): finite and >= 0; 0 means no pull."""
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"lam must be finite and >= 0. Found {lam}.")
    return lam


@dataclass(frozen=True, kw_only=True)
class DPSGDConfig:
    """Per-silo DP-SGD hyperparameters (the same for every silo; each silo's sampling rate still
    differs, q_k = B_k / n_k).

    The defaults train the small MLP to well above chance on 8x8 digits split over a few dozen
    silos within ~20 rounds (see the module docstring of `trainer.federated`).
    """

    lr: float = 0.5
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    # Expected Poisson batch size; a silo with fewer records than this samples at q = 1.
    batch_size: int = 16
    # DP-SGD steps per round on the model that is shared (Liu et al. 2022 §4: one local epoch per round
    # is about n_k / B_k steps; 150 records / 16 ≈ 10).
    local_steps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and positive. Found {self.lr}.")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be finite and positive. Found {self.clip_norm}.")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0. Found {self.noise_multiplier}.")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive. Found {self.batch_size}.")
        if self.local_steps <= 0:
            raise ValueError(f"local_steps must be positive. Found {self.local_steps}.")


@dataclass(frozen=True)
class RoundResult:
    """What one round did, per silo (CPU tensors, leading dim K).

    `update_norms[k]` is the L2 norm of the noisy update silo k shares with the server this round
    (nan where silo k did not train); the coordinator clusters these norms. `steps[k]` is the number
    of DP-SGD steps silo k actually ran on its data, which equals the `steps` of the mechanism it
    declared, or 0. `queries[k]` counts every query of silo k's data of any kind (DP-SGD steps,
    selections, server-noised steps): a silo with queries > 0 touched its data, so its charge is spent.
    """

    round_index: int
    update_norms: torch.Tensor
    steps: torch.Tensor
    queries: torch.Tensor

    @property
    def trained(self) -> torch.Tensor:
        return self.queries > 0


# Independent random streams derived from one seed, so that e.g. a silo's noise never depends on
# how many silos exist or which of them were approved.
STREAM_INIT = 0
STREAM_SAMPLER = 1
STREAM_NOISE = 2
STREAM_CLIENTS = 3


def derive_seed(seed: int, *stream: int) -> int:
    """A 63-bit seed for one named stream, via NumPy's SeedSequence (well-mixed, collision-free in
    practice for distinct stream tuples)."""
    state = np.random.SeedSequence([seed, *stream]).generate_state(1, dtype=np.uint64)[0]
    return int(state) & ((1 << 63) - 1)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
