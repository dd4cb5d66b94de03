"""Federated algorithms batched over silos: the batched DP step against a one-silo-at-a-time,
one-example-at-a-time oracle, the exact privacy cost each algorithm declares, frozen refused silos,
and a learning sanity check on synthetic Gaussian blobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from dpledger.trainer.federated import (
    MRMTL,
    PPSGD,
    Ditto,
    DPSGDConfig,
    FedAvg,
    FederatedAlgorithm,
    FlatModel,
    LocalTraining,
    build_model,
)
from dpledger.trainer.federated.config import (
    STREAM_NOISE,
    STREAM_SAMPLER,
    derive_seed,
    make_generator,
)
from dpledger.trainer.federated.engine import SiloEngine
from dpledger.trainer.federated.padded import PaddedSilos
from dpledger.trainer.silo.dpsgd.batched import noisy_clipped_gradient, pad_batches
from dpledger.trainer.silo.dpsgd.sampler import PoissonSampler
from tests.trainer import wire

CPU = torch.device("cpu")
NUM_CLASSES = 4
FEATURES = 8


def blobs(
    *, silos: int, n_train: list[int] | int, n_test: int = 40, seed: int = 0, spread: float = 1.0
) -> dict[str, list[torch.Tensor]]:
    """Gaussian blobs: shared class means, a small per-silo shift (heterogeneity)."""
    g = torch.Generator().manual_seed(seed)
    means = 3.0 * torch.randn(NUM_CLASSES, FEATURES, generator=g)
    sizes = n_train if isinstance(n_train, list) else [n_train] * silos
    out: dict[str, list[torch.Tensor]] = {"x_train": [], "y_train": [], "x_test": [], "y_test": []}
    for k in range(silos):
        shift = 0.5 * torch.randn(FEATURES, generator=g)
        for split, n in (("train", sizes[k]), ("test", n_test)):
            y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
            x = means[y] + shift + spread * torch.randn(n, FEATURES, generator=g)
            out[f"x_{split}"].append(x)
            out[f"y_{split}"].append(y)
    return out


def make(name: str, data: dict[str, list[torch.Tensor]], config: DPSGDConfig, **extra: Any) -> FederatedAlgorithm:
    common: dict[str, Any] = {**data, "config": config, "num_classes": NUM_CLASSES, **extra}
    builders: dict[str, Callable[[], FederatedAlgorithm]] = {
        "local": lambda: LocalTraining(**common),
        "fedavg": lambda: FedAvg(**common),
        "mrmtl": lambda: MRMTL(lam=0.5, **common),
        "ditto": lambda: Ditto(lam=0.5, personal_steps=2, **common),
        "ppsgd": lambda: PPSGD(alpha=1.0, client_rate=0.7, **common),
    }
    return builders[name]()


ALGORITHMS = ["local", "fedavg", "mrmtl", "ditto", "ppsgd"]


def run(algorithm: FederatedAlgorithm, rounds: int, start: int = 0) -> None:
    for r in range(start, start + rounds):
        declared = wire(algorithm.round_mechanisms(r))
        algorithm.run_round(r, torch.tensor([m is not None for m in declared]))


# ----- the batched DP step against a one-at-a-time oracle --------------------------------------


def reference_gradient(
    module: nn.Module,
    flat: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch: float,
    noise_generator: torch.Generator,
) -> torch.Tensor:
    """One silo, one example at a time, with autograd on an ordinary module."""
    nn.utils.vector_to_parameters(flat.clone(), module.parameters())
    total = torch.zeros_like(flat)
    for i in range(x.shape[0]):
        module.zero_grad()
        nn.functional.cross_entropy(module(x[i : i + 1]), y[i : i + 1]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])
        total += g * min(1.0, clip_norm / g.norm().item()) if g.norm() > 0 else g
    if noise_multiplier > 0:
        total += noise_multiplier * clip_norm * torch.randn(flat.numel(), generator=noise_generator)
    return total / expected_batch


@pytest.mark.parametrize("noise_multiplier", [0.0, 1.3])
def test_batched_gradient_matches_one_example_at_a_time(noise_multiplier: float) -> None:
    torch.manual_seed(0)
    module = build_model("mlp", in_features=FEATURES, out_features=NUM_CLASSES, hidden=6)
    model = FlatModel(module, task="classification")
    silos = 4
    params = model.initial().unsqueeze(0) + 0.3 * torch.randn(silos, model.size)
    lengths = [5, 0, 9, 2]  # silo 1 drew an empty Poisson batch
    xs = [3 * torch.randn(n, FEATURES) for n in lengths]  # large inputs, so most gradients are clipped
    ys = [torch.randint(0, NUM_CLASSES, (n,)) for n in lengths]
    idx, mask = pad_batches([torch.arange(n) for n in lengths], device=CPU)
    x_pad = torch.zeros(silos, idx.shape[1], FEATURES)
    y_pad = torch.zeros(silos, idx.shape[1], dtype=torch.int64)
    for k, n in enumerate(lengths):
        x_pad[k, :n], y_pad[k, :n] = xs[k], ys[k]
        x_pad[k, n:] = 1e3  # garbage at padded slots must not matter
    expected = torch.tensor([4.0, 3.0, 8.0, 2.5])
    batched = noisy_clipped_gradient(
        model,
        params,
        x_pad,
        y_pad,
        mask,
        clip_norm=0.7,
        noise_multipliers=noise_multiplier,
        expected_batch_sizes=expected,
        generators=[torch.Generator().manual_seed(100 + k) for k in range(silos)],
    )
    for k in range(silos):
        oracle = reference_gradient(
            module,
            params[k],
            xs[k],
            ys[k],
            clip_norm=0.7,
            noise_multiplier=noise_multiplier,
            expected_batch=float(expected[k]),
            noise_generator=torch.Generator().manual_seed(100 + k),
        )
        torch.testing.assert_close(batched[k], oracle, rtol=1e-5, atol=1e-6)
    if noise_multiplier == 0:
        assert torch.equal(batched[1], torch.zeros(model.size))


def test_a_flower_silos_one_silo_steps_are_the_batched_engines_steps() -> None:
    """A Flower silo's engine takes each step with the library's one-silo step (ghost norms over the
    module), the simulator's with the batched kernel: on the same batches, without noise, both give
    the same gradient, and so the same declared mechanism buys the same training."""
    torch.manual_seed(0)
    data = blobs(silos=3, n_train=[30, 7, 50])
    model = FlatModel(build_model("mlp", in_features=FEATURES, out_features=NUM_CLASSES, hidden=6), task="classification")
    train = PaddedSilos.from_tensors(data["x_train"], data["y_train"], task="classification", device=CPU, allow_empty=False)
    config = DPSGDConfig(batch_size=8, clip_norm=0.5, lr=0.3)

    def engine(one_step_per_silo: bool) -> SiloEngine:
        return SiloEngine(train=train, model=model, config=config, noise_multipliers=[1.0, 2.0, 0.5], device=CPU,
                          streams=lambda stream, k: torch.Generator().manual_seed(1000 * len(stream) + k),
                          one_step_per_silo=one_step_per_silo)

    batched, per_silo = engine(False), engine(True)
    params = model.initial().expand(3, -1) + 0.3 * torch.randn(3, model.size)
    rows = torch.tensor([2, 0, 1])
    for _ in range(3):
        torch.testing.assert_close(per_silo.dp_gradient(params[rows], rows, noised=False),
                                   batched.dp_gradient(params[rows], rows, noised=False), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_silo.dp_sgd(params, torch.arange(3), steps=4, noised=False),
                               batched.dp_sgd(params, torch.arange(3), steps=4, noised=False), rtol=1e-4, atol=1e-5)
    assert [per_silo.mechanism(k, steps=4) for k in range(3)] == [batched.mechanism(k, steps=4) for k in range(3)]
    # With noise, each row's draw comes from that silo's own generator: the noise is σ_k·C / B_k.
    assert per_silo.step is not None and per_silo.step.module is not model.module  # the template keeps its parameters
    noisy = engine(True).dp_gradient(params[:1], torch.tensor([0]))  # fresh engines: the same first batch
    clean = engine(True).dp_gradient(params[:1], torch.tensor([0]), noised=False)
    assert abs(float((noisy - clean).std()) - 1.0 * 0.5 / 8) < 0.2 * 0.5 / 8


def test_zero_gradient_is_clipped_safely() -> None:
    # A regression example predicted exactly has a zero gradient: clipping must not divide by 0.
    model = FlatModel(nn.Linear(3, 1), task="regression")
    params = torch.zeros(1, model.size)
    x = torch.zeros(1, 1, 3)
    y = torch.zeros(1, 1)
    out = noisy_clipped_gradient(
        model,
        params,
        x,
        y,
        torch.ones(1, 1, dtype=torch.bool),
        clip_norm=1.0,
        noise_multipliers=0.0,
        expected_batch_sizes=torch.tensor([1.0]),
        generators=[torch.Generator()],
    )
    assert torch.equal(out, torch.zeros(1, model.size))


def test_full_round_matches_reference_with_the_silos_own_samplers_and_noise() -> None:
    data = blobs(silos=3, n_train=[30, 45, 12])
    config = DPSGDConfig(lr=0.2, clip_norm=0.5, noise_multiplier=0.8, batch_size=8, local_steps=1, seed=7)
    algorithm = LocalTraining(**data, model="linear", num_classes=NUM_CLASSES, config=config)
    initial = algorithm.initial.clone()
    result = algorithm.run_round(0, torch.ones(3, dtype=torch.bool))
    module = build_model("linear", in_features=FEATURES, out_features=NUM_CLASSES)
    for k in range(3):
        n = len(data["y_train"][k])
        sampler = PoissonSampler(
            dataset_size=n, batch_size=min(8, n), generator=make_generator(derive_seed(7, STREAM_SAMPLER, k), CPU)
        )
        batch = sampler.sample()
        oracle = reference_gradient(
            module,
            initial,
            data["x_train"][k][batch],
            data["y_train"][k][batch],
            clip_norm=0.5,
            noise_multiplier=0.8,
            expected_batch=float(min(8, n)),
            noise_generator=make_generator(derive_seed(7, STREAM_NOISE, k), CPU),
        )
        expected = initial - 0.2 * oracle
        torch.testing.assert_close(algorithm.silo_state["personal"][k], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            result.update_norms[k], (expected - initial).norm().to(torch.float64), rtol=1e-5, atol=1e-6
        )
    assert result.steps.tolist() == [1, 1, 1]


# ----- exact equalities and frozen silos --------------------------------------------------------


def test_mrmtl_with_zero_lambda_is_local_training_bitwise() -> None:
    data = blobs(silos=5, n_train=40)
    config = DPSGDConfig(lr=0.3, batch_size=8, local_steps=3, seed=3)
    local = LocalTraining(**data, num_classes=NUM_CLASSES, config=config)
    mrmtl = MRMTL(lam=0.0, **data, num_classes=NUM_CLASSES, config=config)
    approvals = [[1, 1, 1, 1, 1], [1, 0, 1, 0, 1], [0, 1, 1, 1, 1]]
    for r, row in enumerate(approvals):
        approved = torch.tensor(row, dtype=torch.bool)
        a, b = local.run_round(r, approved), mrmtl.run_round(r, approved)
        assert torch.equal(a.update_norms.nan_to_num(-1.0), b.update_norms.nan_to_num(-1.0))
        assert torch.equal(a.steps, b.steps)
    assert torch.equal(local.silo_state["personal"], mrmtl.silo_state["personal"])
    assert torch.equal(local.evaluate(), mrmtl.evaluate())


@pytest.mark.parametrize("name", ALGORITHMS)
def test_refused_silos_are_frozen_bitwise(name: str) -> None:
    data = blobs(silos=6, n_train=30)
    algorithm = make(name, data, DPSGDConfig(lr=0.3, batch_size=8, local_steps=2, seed=1))
    run(algorithm, 1)
    before = algorithm.state()
    approved = torch.tensor([True, False, True, False, True, True])
    declared = wire(algorithm.round_mechanisms(1))
    result = algorithm.run_round(1, approved)
    after = algorithm.state()
    refused = torch.nonzero(~approved).flatten()
    for key, tensor in after.items():
        if tensor.dim() == 2 and tensor.shape[0] == 6:
            assert torch.equal(tensor[refused], before[key][refused]), key
    for k in range(6):
        ran = bool(approved[k]) and declared[k] is not None
        assert result.steps[k] == (declared[k]["steps"] if ran and declared[k] else 0)
        assert torch.isnan(result.update_norms[k]) != ran
    # Refused silos drew no batch and no noise: their generators are where the first round left them.
    fresh = make(name, data, DPSGDConfig(lr=0.3, batch_size=8, local_steps=2, seed=1))
    run(fresh, 1)
    for k in refused.tolist():
        assert torch.equal(algorithm.samplers[k].generator.get_state(), fresh.samplers[k].generator.get_state())
        assert torch.equal(algorithm.engine.noise_generators[k].get_state(), fresh.engine.noise_generators[k].get_state())


def test_nothing_approved_changes_nothing() -> None:
    data = blobs(silos=3, n_train=20)
    algorithm = make("fedavg", data, DPSGDConfig(batch_size=4, local_steps=2))
    before = algorithm.state()
    result = algorithm.run_round(0, torch.zeros(3, dtype=torch.bool))
    assert all(torch.equal(before[key], value) for key, value in algorithm.state().items())
    assert result.steps.tolist() == [0, 0, 0] and bool(result.update_norms.isnan().all())


def test_empty_poisson_batches_are_handled() -> None:
    # q = 1/60: most batches are empty, some silos' whole step is noise only.
    data = blobs(silos=4, n_train=60)
    config = DPSGDConfig(lr=0.1, batch_size=1, local_steps=20, noise_multiplier=1.0, seed=2)
    algorithm = MRMTL(lam=0.1, **data, num_classes=NUM_CLASSES, config=config)
    result = algorithm.run_round(0, torch.ones(4, dtype=torch.bool))
    assert result.steps.tolist() == [20] * 4
    assert bool(torch.isfinite(result.update_norms).all()) and bool(torch.isfinite(algorithm.silo_state["personal"]).all())
    idx, mask = pad_batches([torch.empty(0, dtype=torch.int64)] * 3, device=CPU)
    assert idx.shape == (3, 0) and mask.shape == (3, 0)


# ----- declared mechanisms ----------------------------------------------------------------------


def test_each_silo_declares_its_own_samplers_batch_size() -> None:
    data = blobs(silos=3, n_train=[50, 200, 6])
    config = DPSGDConfig(batch_size=10, local_steps=4, noise_multiplier=1.1)
    for name in ALGORITHMS:
        algorithm = make(name, data, config)
        for k, mechanism in enumerate(wire(algorithm.round_mechanisms(0))):
            if mechanism is None:
                continue
            assert mechanism["type"] == "dpsgd" and mechanism["noise_multiplier"] == 1.1
            assert mechanism["batch_size"] == algorithm.samplers[k].batch_size == min(10, [50, 200, 6][k])
            assert mechanism == algorithm.samplers[k].mechanism(noise_multiplier=1.1, steps=mechanism["steps"])


def test_ditto_declares_its_extra_local_steps() -> None:
    data = blobs(silos=3, n_train=30)
    ditto = Ditto(lam=0.1, personal_steps=3, **data, num_classes=NUM_CLASSES, config=DPSGDConfig(local_steps=4))
    assert [m["steps"] for m in wire(ditto.round_mechanisms(0)) if m is not None] == [7, 7, 7]
    result = ditto.run_round(0, torch.ones(3, dtype=torch.bool))
    assert result.steps.tolist() == [7, 7, 7]
    for name in ("local", "fedavg", "mrmtl"):
        mechanisms = wire(make(name, data, DPSGDConfig(local_steps=4)).round_mechanisms(0))
        assert [m["steps"] for m in mechanisms if m is not None] == [4, 4, 4]


def test_ppsgd_unsampled_silos_declare_and_run_nothing() -> None:
    data = blobs(silos=12, n_train=20)
    algorithm = PPSGD(
        alpha=0.5, client_rate=0.4, **data, num_classes=NUM_CLASSES, config=DPSGDConfig(local_steps=2, batch_size=4)
    )
    seen_unsampled = False
    for r in range(4):
        declared = wire(algorithm.round_mechanisms(r))
        assert declared == wire(algorithm.round_mechanisms(r))  # a pure function of the round
        sampled = algorithm.server.asks(r)
        assert [m is not None for m in declared] == sampled.tolist()
        seen_unsampled |= not bool(sampled.all())
        before = algorithm.state()["local"]
        # Approve everyone, even silos that declared nothing: those must still not run.
        result = algorithm.run_round(r, torch.ones(12, dtype=torch.bool))
        assert result.steps.tolist() == [2 if s else 0 for s in sampled.tolist()]
        assert torch.equal(algorithm.state()["local"][~sampled], before[~sampled])
    assert seen_unsampled


def test_round_protocol_is_validated() -> None:
    algorithm = make("local", blobs(silos=2, n_train=10), DPSGDConfig(batch_size=4, local_steps=1))
    with pytest.raises(ValueError, match="bool tensor of shape"):
        algorithm.run_round(0, torch.ones(3, dtype=torch.bool))
    algorithm.run_round(0, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="must exceed the last round"):
        algorithm.run_round(0, torch.ones(2, dtype=torch.bool))


# ----- learning, reproducibility ----------------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHMS)
def test_each_algorithm_learns_separable_blobs(name: str) -> None:
    data = blobs(silos=6, n_train=100, seed=5)
    config = DPSGDConfig(lr=0.5, clip_norm=1.0, noise_multiplier=1.0, batch_size=16, local_steps=5, seed=0)
    algorithm = make(name, data, config)
    chance = 1.0 / NUM_CLASSES
    run(algorithm, 8)
    accuracy = float(algorithm.evaluate().mean())
    assert accuracy > chance + 0.45, (name, accuracy)


def test_ppsgd_linear_regression_additive_model_reduces_error() -> None:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(FEATURES, generator=g)
    data: dict[str, list[torch.Tensor]] = {"x_train": [], "y_train": [], "x_test": [], "y_test": []}
    for _ in range(5):
        personal = shared + 0.3 * torch.randn(FEATURES, generator=g)  # Bietti et al. 2022 eq. (3): w + θ_i
        for split, n in (("train", 120), ("test", 40)):
            x = torch.randn(n, FEATURES, generator=g)
            data[f"x_{split}"].append(x)
            data[f"y_{split}"].append(x @ personal + 0.1 * torch.randn(n, generator=g))
    config = DPSGDConfig(lr=0.3, clip_norm=2.0, noise_multiplier=0.5, batch_size=20, local_steps=5)
    algorithm = PPSGD(alpha=2.0, **data, model="linear", task="regression", config=config)
    initial = algorithm.evaluate()
    run(algorithm, 10)
    assert float(algorithm.evaluate().mean()) < 0.2 * float(initial.mean())


def test_reproducible_from_a_seed() -> None:
    data = blobs(silos=4, n_train=40)
    for name in ALGORITHMS:
        states = []
        for seed in (11, 11, 12):
            algorithm = make(name, data, DPSGDConfig(batch_size=8, local_steps=2, seed=seed))
            run(algorithm, 2)
            states.append(algorithm.state())
        assert all(torch.equal(states[0][key], states[1][key]) for key in states[0]), name
        assert not all(torch.equal(states[0][key], states[2][key]) for key in states[0]), name


def test_each_silo_declares_and_runs_its_own_noise_multiplier() -> None:
    data = blobs(silos=3, n_train=[30, 45, 12])
    config = DPSGDConfig(lr=0.2, clip_norm=0.5, batch_size=8, local_steps=1, seed=7)
    sigmas = [0.5, 3.0, 40.0]
    algorithm = LocalTraining(**data, model="linear", num_classes=NUM_CLASSES, config=config, noise_multipliers=sigmas)
    assert [m["noise_multiplier"] for m in wire(algorithm.round_mechanisms(0))] == sigmas
    initial = algorithm.initial.clone()
    algorithm.run_round(0, torch.ones(3, dtype=torch.bool))
    module = build_model("linear", in_features=FEATURES, out_features=NUM_CLASSES)
    for k in range(3):
        n = len(data["y_train"][k])
        sampler = PoissonSampler(
            dataset_size=n, batch_size=min(8, n), generator=make_generator(derive_seed(7, STREAM_SAMPLER, k), CPU)
        )
        batch = sampler.sample()
        oracle = reference_gradient(
            module, initial, data["x_train"][k][batch], data["y_train"][k][batch], clip_norm=0.5,
            noise_multiplier=sigmas[k], expected_batch=float(min(8, n)),
            noise_generator=make_generator(derive_seed(7, STREAM_NOISE, k), CPU),
        )
        torch.testing.assert_close(algorithm.silo_state["personal"][k], initial - 0.2 * oracle, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one finite σ"):
        LocalTraining(**data, model="linear", num_classes=NUM_CLASSES, config=config, noise_multipliers=[1.0, 2.0])
