"""The engine's DP-SGD gradient for many silos at once: one batched computation over stacked [K, P] parameters.

What the simulator runs over its K silos (`dpledger.trainer.federated.engine`), where one silo's
step (`step.private_gradient`, over a module) would be K separate computations. The phases are the
engine's: Poisson batches per silo, padded to a common size with a mask;
per-sample gradients; per-sample clipping to C; sum; Gaussian noise N(0, σ²C²) per silo from that
silo's own generator; division by the silo's expected batch size B_k (Abadi et al. 2016, Alg. 1;
Liu et al. 2022 §5, "Federation as noise reduction", writes the same step with a noise term per silo).

The simulated models are small (at most a few thousand parameters), so per-sample gradients are
materialised as a [A, b, P] tensor with `vmap(grad)`; ghost clipping (`norms`, in the one-silo step)
is what larger models need. Silos are processed in chunks so that tensor stays under a memory cap.
The clip factor and the noise draw are the engine's own (`clip`, `noise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch.func import grad, vmap

from dpledger.trainer.silo.dpsgd import noise
from dpledger.trainer.silo.dpsgd.clip import clip_factors

# Cap on the elements of one per-sample gradient tensor (2**25 float32 = 128 MiB).
MAX_PER_SAMPLE_ELEMENTS = 2**25


class FlatLoss(Protocol):
    """A model seen as a function of one flat parameter vector: its size P and one example's loss."""

    @property
    def size(self) -> int: ...

    def example_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one example (x: [d], y: a scalar) at parameters `flat` ([P])."""
        ...


def pad_batches(indices: Sequence[torch.Tensor], *, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-size Poisson batches (one index tensor per silo, possibly empty) → padded
    indices [A, b_max] and mask [A, b_max]; padding points at record 0 and is masked out."""
    lengths = torch.tensor([len(i) for i in indices], dtype=torch.int64, device=device)
    b_max = int(lengths.max().item()) if len(indices) else 0
    idx = torch.zeros(len(indices), b_max, dtype=torch.int64, device=device)
    mask = torch.zeros(len(indices), b_max, dtype=torch.bool, device=device)
    if b_max == 0:
        return idx, mask
    flat = torch.cat([i.to(device=device, dtype=torch.int64) for i in indices])
    rows = torch.repeat_interleave(torch.arange(len(indices), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(flat.numel(), device=device) - torch.repeat_interleave(starts, lengths)
    idx[rows, cols] = flat
    mask[rows, cols] = True
    return idx, mask


def per_sample_gradients(model: FlatLoss, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[A, b, P] gradients of each example's loss at its own silo's parameters (params: [A, P])."""
    per_example = vmap(grad(model.example_loss), in_dims=(None, 0, 0))
    gradients: torch.Tensor = vmap(per_example, in_dims=(0, 0, 0))(params, x, y)
    return gradients


def clip_and_sum(grads: torch.Tensor, mask: torch.Tensor, *, clip_norm: float) -> torch.Tensor:
    """Σ_i clip_C(g_i) over the unmasked examples of each silo ([A, b, P] → [A, P]).

    The clip factor is the engine's (`trainer.silo.dpsgd.clip.clip_factors`). The mask is folded into
    the per-example factors so the clipped sum is one batched matrix product (one pass over the
    [A, b, P] tensor). That is safe because padding slots point at a real record (index 0), so their
    gradients are finite whenever the real ones are.
    """
    norms = torch.linalg.vector_norm(grads, dim=-1)
    factors = torch.where(mask, clip_factors(norms, max_grad_norm=clip_norm), 0.0)
    return torch.einsum("abp,ab->ap", grads, factors)


def gaussian_noise(
    generators: Sequence[torch.Generator], *, size: int, std: float, device: torch.device
) -> torch.Tensor:
    """[A, size] noise, row a drawn from generators[a]: each silo privatises its own sum with its
    own randomness (Liu et al. 2022 §3: no trusted server, and §5 fn. 4: noise independent across silos)."""
    return torch.stack([noise.gaussian_noise((size,), std=1.0, generator=g, device=device) for g in generators]) * std


def noisy_clipped_gradient(
    model: FlatLoss,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_norm: float,
    noise_multipliers: torch.Tensor | float,
    expected_batch_sizes: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """One DP-SGD gradient per silo: (Σ_i clip_C(g_i) + N(0, σ²C² I)) / B_k.

    params [A, P]; x [A, b, d]; y, mask [A, b]; expected_batch_sizes [A] (B_k, not the realised
    batch size: dividing by the realised size would make the sensitivity data-dependent). Masked
    slots must hold finite inputs (`pad_batches` points them at a real record).
    """
    num, batch = mask.shape
    if batch == 0:
        summed = torch.zeros_like(params)
    else:
        chunk = max(1, MAX_PER_SAMPLE_ELEMENTS // (batch * model.size))
        summed = torch.cat(
            [
                clip_and_sum(
                    per_sample_gradients(model, params[s : s + chunk], x[s : s + chunk], y[s : s + chunk]),
                    mask[s : s + chunk],
                    clip_norm=clip_norm,
                )
                for s in range(0, num, chunk)
            ]
        )
    sigma = torch.as_tensor(noise_multipliers, dtype=summed.dtype, device=summed.device).expand(num)
    if bool((sigma > 0).any()):
        std = (sigma * clip_norm).unsqueeze(1)
        summed = summed + gaussian_noise(generators, size=model.size, std=1.0, device=params.device) * std
    return summed / expected_batch_sizes.to(summed.dtype).unsqueeze(1)
