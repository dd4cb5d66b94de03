"""PMTL's noisy global learner ("Private Multi-Task Learning", Alg. 1), research code no algorithm runs."""

from __future__ import annotations

import pytest
import torch
from pydantic import TypeAdapter

from dpledger.wire.mechanisms import Mechanism

from research.pmtl import pmtl_record_level_mechanism, pmtl_round_mechanism, pmtl_server_step, sample_tasks

WIRE = TypeAdapter(Mechanism)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_pmtl_step_without_noise_is_the_clipped_sum_over_the_expected_count() -> None:
    w = torch.tensor([1.0, 1.0], dtype=torch.float64)
    updates = torch.tensor([[3.0, 4.0], [0.3, 0.4], [-1.0, 0.0], [100.0, 0.0]], dtype=torch.float64)
    selected = torch.tensor([True, True, True, False])
    out = pmtl_server_step(
        w, updates, selected, clip_norm=1.0, noise_multiplier=0.0, sampling_rate=0.5, generator=generator(0)
    )
    expected = w + (torch.tensor([0.6, 0.8]) + torch.tensor([0.3, 0.4]) + torch.tensor([-1.0, 0.0])).double() / (0.5 * 4)
    assert torch.allclose(out, expected, atol=1e-12)


def test_pmtl_noise_has_standard_deviation_z_gamma_over_expected_count() -> None:
    k, p, z, gamma, rate = 10, 4000, 1.3, 0.5, 0.4
    w = torch.zeros(p, dtype=torch.float64)
    updates = torch.zeros(k, p, dtype=torch.float64)
    out = pmtl_server_step(
        w, updates, torch.zeros(k, dtype=torch.bool), clip_norm=gamma, noise_multiplier=z, sampling_rate=rate,
        generator=generator(3),
    )
    assert out.std().item() == pytest.approx(z * gamma / (rate * k), rel=0.05)


def test_pmtl_mechanisms_are_valid_wire_mechanisms() -> None:
    sampled = pmtl_round_mechanism(sampling_rate=0.2, noise_multiplier=1.1)
    assert sampled == {
        "type": "poisson_sampled",
        "sampling_rate": 0.2,
        "event": {"type": "gaussian", "noise_multiplier": 1.1},
    }
    WIRE.validate_python(sampled)
    record = pmtl_record_level_mechanism(noise_multiplier=1.1)
    assert record == {"type": "gaussian", "noise_multiplier": 0.55}
    WIRE.validate_python(record)
    with pytest.raises(ValueError, match=r"sampling_rate must be in \(0, 1\]"):
        pmtl_round_mechanism(sampling_rate=0.0, noise_multiplier=1.0)


def test_sample_tasks_is_poisson_at_the_rate() -> None:
    picks = sample_tasks(100_000, sampling_rate=0.3, generator=generator(4))
    assert picks.dtype == torch.bool
    assert picks.double().mean().item() == pytest.approx(0.3, abs=0.005)
