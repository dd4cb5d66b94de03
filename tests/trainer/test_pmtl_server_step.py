"""PMTL's server step: clipped updates of the silos that trained, noise zγ, divided by the number asked."""

from __future__ import annotations

import re

import pytest
import torch

from dpledger.trainer.federated.pmtl import record_level_mechanism, server_step


def test_the_step_clips_sums_noises_and_divides_by_the_silos_asked() -> None:
    mean = torch.zeros(2, dtype=torch.float64)
    models = torch.tensor([[3.0, 4.0], [0.3, 0.4], [float("nan"), 1.0]], dtype=torch.float64)  # silo 2 did not train
    trained = torch.tensor([True, True, False])
    got = server_step(mean, models, trained, update_clip=1.0, server_noise=2.0, generator=torch.Generator().manual_seed(5))
    noise = torch.randn(2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    # [3, 4] has norm 5: clipped to [0.6, 0.8]; [0.3, 0.4] has norm 0.5: kept; the untrained row is never read.
    expected = (torch.tensor([0.6 + 0.3, 0.8 + 0.4], dtype=torch.float64) + 2.0 * noise) / 3
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


def test_one_silo_moves_the_noiseless_sum_by_at_most_the_clip_norm() -> None:
    mean = torch.zeros(4, dtype=torch.float64)
    models = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 10
    with_it, without = torch.tensor([True, True, True]), torch.tensor([True, True, False])
    a = server_step(mean, models, with_it, update_clip=0.5, server_noise=1.0, generator=torch.Generator().manual_seed(2))
    b = server_step(mean, models, without, update_clip=0.5, server_noise=1.0, generator=torch.Generator().manual_seed(2))
    assert float(torch.linalg.vector_norm((a - b) * 3)) <= 0.5 + 1e-12


def test_a_round_is_charged_the_gaussian_at_half_the_server_noise() -> None:
    assert record_level_mechanism(server_noise=3.0).model_dump() == {"type": "gaussian", "noise_multiplier": 1.5}
    with pytest.raises(ValueError, match=re.escape("server_noise must be finite and > 0. Found 0.0.")):
        record_level_mechanism(server_noise=0.0)
