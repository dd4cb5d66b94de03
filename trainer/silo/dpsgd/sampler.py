"""Poisson sampling of batches, and the mechanism that sampling implies.

The sampler is the single source of the sampling rate: the mechanism a worker asks the ledger to
approve comes from the sampler it runs ("the mechanism a worker declares is the sampler
it runs"), and the service recomputes q = batch_size / dataset_size from the silo's registered
size rather than trusting ours.
"""

from __future__ import annotations

from typing import Any

import torch

from dpledger.wire.mechanisms import DpSgd


class PoissonSampler:
    """Each record joins a batch independently with probability q = batch_size / dataset_size.

    Batch sizes vary and may be zero; that is what the Poisson-subsampled Gaussian accounting
    assumes (Abadi et al. 2016; dp-accounting's PoissonSampledDpEvent).
    """

    kind = "poisson"

    def __init__(self, *, dataset_size: int, batch_size: int, generator: torch.Generator) -> None:
        if dataset_size <= 0:
            raise ValueError(f"dataset_size must be positive. Found {dataset_size}.")
        if not 0 < batch_size <= dataset_size:
            raise ValueError(f"batch_size must be in (0, dataset_size={dataset_size}]. Found {batch_size}.")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.generator = generator

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.dataset_size

    def sample(self) -> torch.Tensor:
        """Indices of one batch (int64, possibly empty)."""
        keep = torch.rand(self.dataset_size, generator=self.generator, device=self.generator.device)
        return torch.nonzero(keep < self.sampling_rate, as_tuple=False).flatten()

    def dpsgd(self, *, noise_multiplier: float, steps: int) -> DpSgd:
        """The `dpsgd` mechanism that `steps` batches of this sampler with Gaussian noise
        `noise_multiplier` imply. It names batch_size, never q: the ledger divides by the silo's
        registered dataset_size itself."""
        return DpSgd(batch_size=self.batch_size, noise_multiplier=float(noise_multiplier), steps=int(steps))

    def mechanism(self, *, noise_multiplier: float, steps: int) -> dict[str, Any]:
        """`dpsgd(...)` as its JSON object, for code that composes mechanisms as plain data."""
        return self.dpsgd(noise_multiplier=noise_multiplier, steps=steps).model_dump(mode="json", exclude_none=True)
