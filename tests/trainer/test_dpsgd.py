"""DP-SGD: ghost norms and the clipped sum against a one-example-at-a-time oracle, clipping, the
noise's scale, Poisson sampling, determinism."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy import stats  # type: ignore[import-untyped]  # scipy ships no type information
from torch import Tensor, nn

from dpledger.trainer.silo.dpsgd.norms import layer_grads, per_sample_grad_norms
from dpledger.trainer.silo.dpsgd.sampler import PoissonSampler
from dpledger.trainer.silo.dpsgd.step import (
    add_gaussian_noise,
    clip_factors,
    clipped_grad_sum,
    dp_sgd_step,
)

# Two-sided level of every statistical check: with fixed seeds the tests are deterministic, and
# this level keeps them far from flaky if a seed or the RNG ever changes.
ALPHA = 1e-6

cross_entropy = nn.CrossEntropyLoss(reduction="none")


class MeanOverPositions(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(inplace=True), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),  # T=64: 2T² > p·d, per-sample (batch-as-groups) rule
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, dilation=(1, 2)),  # T=6: 2T² < p·d, Gram rule
        nn.ReLU(),
        nn.Conv2d(8, 4, 1, groups=2),  # grouped: per-sample rule
        nn.Flatten(),
        nn.Linear(4 * 3 * 2, 5),
    )


def fallback_net() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 5))


def sequence_net() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(20, 8),  # fallback rule
        nn.Linear(8, 16),  # T=5, 2T² < p·d: Gram rule
        nn.ReLU(),
        nn.Linear(16, 2),  # 2T² > p·d: per-sample rule
        MeanOverPositions(),
    )


def frozen_first_layer() -> nn.Module:
    model = mlp()
    model[0].weight.requires_grad_(False)
    return model


Case = tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[Tensor, Tensor]], set[str]]


def dense_batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(7, 12, generator=generator, dtype=torch.float64), torch.randint(0, 5, (7,), generator=generator)


def image_batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(7, 3, 8, 8, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 5, (7,), generator=generator)


def token_batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randint(0, 20, (7, 5), generator=generator), torch.randint(0, 2, (7,), generator=generator)


CASES: dict[str, Case] = {
    "mlp": (mlp, dense_batch, {"_LinearGhost"}),
    "cnn": (cnn, image_batch, {"_Conv2dPerSample", "_TokenLayer", "_LinearGhost"}),
    "layernorm": (fallback_net, dense_batch, {"_LinearGhost", "_FunctionalPerSample"}),
    "sequence": (sequence_net, token_batch, {"_FunctionalPerSample", "_TokenLayer"}),
    "frozen": (frozen_first_layer, dense_batch, {"_LinearGhost"}),
}


def build(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    make_model, make_batch, _ = CASES[name]
    torch.manual_seed(0)
    model = make_model().double()
    x, y = make_batch(torch.Generator().manual_seed(1))
    return model, x, y


def oracle(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor) -> list[list[Tensor]]:
    """Each example's gradient, one example at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1]).sum()
        grads.append(list(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)))
    return grads


def oracle_norm(grads: list[Tensor]) -> Tensor:
    return torch.sqrt(torch.stack([g.square().sum() for g in grads]).sum())


@pytest.mark.parametrize("name", list(CASES))
def test_norms_and_clipped_sum_match_one_example_at_a_time(name: str) -> None:
    model, x, y = build(name)
    per_example = oracle(model, cross_entropy, x, y)
    expected_norms = torch.stack([oracle_norm(g) for g in per_example])

    norms = per_sample_grad_norms(model, cross_entropy, x, y)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-10, atol=1e-12)

    # C at the median norm clips some examples and leaves others whole.
    max_grad_norm = float(expected_norms.median())
    clipped = clipped_grad_sum(model, cross_entropy, x, y, max_grad_norm=max_grad_norm)
    for k, summed in enumerate(clipped.grads):
        expected = sum(
            min(1.0, max_grad_norm / float(n)) * g[k] for g, n in zip(per_example, expected_norms, strict=True)
        )
        torch.testing.assert_close(summed, expected, rtol=1e-10, atol=1e-12)
    assert [p.grad for p in model.parameters()] == [None] * len(list(model.parameters()))


@pytest.mark.parametrize("name", list(CASES))
def test_each_layer_takes_its_intended_rule(name: str) -> None:
    model, x, y = build(name)
    assert {type(layer).__name__ for layer in layer_grads(model, cross_entropy, x, y)} == CASES[name][2]


def test_clipped_per_sample_norms_are_at_most_c() -> None:
    model, x, y = build("cnn")
    per_example = oracle(model, cross_entropy, x, y)
    norms = per_sample_grad_norms(model, cross_entropy, x, y)
    max_grad_norm = float(norms.min()) / 2  # every example is clipped
    factors = clip_factors(norms, max_grad_norm=max_grad_norm)
    for grads, factor in zip(per_example, factors, strict=True):
        clipped_norm = oracle_norm([factor * g for g in grads])
        assert clipped_norm <= max_grad_norm * (1 + 1e-12)
        assert clipped_norm == pytest.approx(max_grad_norm, rel=1e-10)


def test_zero_gradient_example_gives_factor_one_and_no_nan() -> None:
    model, x, y = build("mlp")
    silenced = torch.ones(x.shape[0], dtype=torch.float64)
    silenced[2] = 0.0

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        losses: Tensor = cross_entropy(output, target)
        return losses * silenced[: output.shape[0]]

    clipped = clipped_grad_sum(model, loss_fn, x, y, max_grad_norm=0.1)
    assert clipped.norms[2] == 0
    assert clip_factors(clipped.norms, max_grad_norm=0.1)[2] == 1
    assert all(torch.isfinite(g).all() for g in clipped.grads)
    torch.testing.assert_close(
        clip_factors(torch.tensor([0.0, 0.5, 1.0, 4.0]), max_grad_norm=1.0), torch.tensor([1.0, 1.0, 1.0, 0.25])
    )


def test_empty_batch_has_zero_clipped_sum() -> None:
    model, x, y = build("cnn")
    clipped = clipped_grad_sum(model, cross_entropy, x[:0], y[:0], max_grad_norm=1.0)
    assert clipped.norms.shape == (0,)
    assert all(torch.count_nonzero(g) == 0 for g in clipped.grads)


def test_noise_std_is_sigma_c_over_expected_batch_size() -> None:
    """With a zero gradient the update is noise / B. n·s²/σ₀² of n such coordinates is χ²(n) for
    σ₀ = σC/B; realized batch sizes 0, 3 and 17 around B = 10 would move s by 30% to ∞ if the step
    divided by them."""
    torch.manual_seed(0)
    model = nn.Linear(64, 32).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    generator = torch.Generator().manual_seed(2024)
    noise_multiplier, max_grad_norm, expected_batch_size = 1.3, 0.7, 10.0

    def zero_loss(output: Tensor, target: Tensor) -> Tensor:
        return output.sum(dim=1) * 0.0

    deltas: list[Tensor] = []
    for step in range(30):
        batch = (0, 3, 17)[step % 3]
        before = [p.detach().clone() for p in model.parameters()]
        stats_ = dp_sgd_step(
            model,
            zero_loss,
            torch.randn(batch, 64, dtype=torch.float64),
            torch.zeros(batch),
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            generator=generator,
            optimizer=optimizer,
        )
        assert stats_.batch_size == batch
        deltas.extend((p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True))
    sample = torch.cat(deltas)
    n = sample.numel()
    sigma0 = noise_multiplier * max_grad_norm / expected_batch_size
    statistic = float(sample.square().sum()) / sigma0**2
    assert stats.chi2.ppf(ALPHA / 2, n) <= statistic <= stats.chi2.ppf(1 - ALPHA / 2, n)
    assert abs(float(sample.mean())) <= stats.norm.ppf(1 - ALPHA / 2) * sigma0 / n**0.5


def test_add_gaussian_noise_is_reproducible_and_checks_std() -> None:
    grads = [torch.zeros(3, 4), torch.ones(5)]
    first = add_gaussian_noise(grads, std=2.0, generator=torch.Generator().manual_seed(5))
    second = add_gaussian_noise(grads, std=2.0, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(torch.count_nonzero(g) == 0 for g in grads[:1])  # the input is not modified
    with pytest.raises(ValueError, match=r"std must be finite and >= 0. Found -1.0."):
        add_gaussian_noise(grads, std=-1.0, generator=torch.Generator())


def test_poisson_sampler_rate_matches_q() -> None:
    sampler = PoissonSampler(dataset_size=5000, batch_size=50, generator=torch.Generator().manual_seed(3))
    draws = 400
    total = 0
    for _ in range(draws):
        batch = sampler.sample()
        assert batch.dtype == torch.int64
        assert torch.equal(batch, torch.unique(batch))
        assert batch.numel() == 0 or (int(batch.min()) >= 0 and int(batch.max()) < 5000)
        total += batch.numel()
    low, high = stats.binom.interval(1 - ALPHA, draws * 5000, sampler.sampling_rate)
    assert low <= total <= high


def test_poisson_sampler_yields_empty_batches_when_q_is_small() -> None:
    sampler = PoissonSampler(dataset_size=2000, batch_size=1, generator=torch.Generator().manual_seed(4))
    draws = 300
    empty = sum(sampler.sample().numel() == 0 for _ in range(draws))
    p_empty = (1 - sampler.sampling_rate) ** 2000
    low, high = stats.binom.interval(1 - ALPHA, draws, p_empty)
    assert empty > 0
    assert low <= empty <= high


def test_sampler_mechanism_is_what_the_worker_declares() -> None:
    sampler = PoissonSampler(dataset_size=60_000, batch_size=256, generator=torch.Generator())
    assert sampler.mechanism(noise_multiplier=1.1, steps=235) == {
        "type": "dpsgd",
        "batch_size": 256,
        "noise_multiplier": 1.1,
        "steps": 235,
    }


def train(*, seed: int, steps: int = 3) -> list[Tensor]:
    torch.manual_seed(0)
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(9))
    labels = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(9))
    sampler = PoissonSampler(dataset_size=64, batch_size=8, generator=torch.Generator().manual_seed(seed))
    noise = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = sampler.sample()
        dp_sgd_step(
            model,
            cross_entropy,
            data[batch],
            labels[batch],
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=float(sampler.batch_size),
            generator=noise,
            optimizer=optimizer,
        )
    return [p.detach().clone() for p in model.parameters()]


def test_same_seed_gives_identical_parameters() -> None:
    first, second, other = train(seed=11), train(seed=11), train(seed=12)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_step_reports_private_update_norm_and_diagnostics() -> None:
    model, x, y = build("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stats_ = dp_sgd_step(
        model,
        cross_entropy,
        x,
        y,
        max_grad_norm=1e-6,
        noise_multiplier=0.0,
        expected_batch_size=7.0,
        generator=torch.Generator().manual_seed(0),
        optimizer=optimizer,
    )
    assert stats_.batch_size == 7
    assert stats_.clipped_fraction == 1.0
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert stats_.noisy_update_norm == pytest.approx(float(expected))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_grad_norm": 0.0}, r"max_grad_norm must be finite and > 0. Found 0.0."),
        ({"noise_multiplier": float("nan")}, r"noise_multiplier must be finite and >= 0. Found nan."),
        ({"expected_batch_size": -2.0}, r"expected_batch_size must be finite and > 0. Found -2.0."),
    ],
)
def test_step_rejects_bad_numbers(kwargs: dict[str, float], message: str) -> None:
    model, x, y = build("mlp")
    arguments = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 7.0} | kwargs
    with pytest.raises(ValueError, match=message):
        dp_sgd_step(
            model,
            cross_entropy,
            x,
            y,
            generator=torch.Generator(),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            **arguments,
        )


def test_models_without_per_sample_gradients_are_refused() -> None:
    batchnorm = nn.Sequential(nn.Linear(12, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)).double()
    x, y = dense_batch(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"Module '1' is a BatchNorm in training mode"):
        per_sample_grad_norms(batchnorm, cross_entropy, x, y)

    shared = nn.Linear(12, 12).double()
    reused = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(12, 5)).double()
    with pytest.raises(ValueError, match=r"Module '0' was called more than once"):
        per_sample_grad_norms(reused, cross_entropy, x, y)


class ScalesItsInputAfterUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x: Tensor) -> Tensor:
        hidden = x * 1.0
        out: Tensor = self.linear(hidden)
        hidden.mul_(2.0)  # the activation the Linear saw is gone
        return out


def test_stale_activation_is_refused() -> None:
    x, y = dense_batch(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"An input of module 'linear' was modified in place"):
        per_sample_grad_norms(ScalesItsInputAfterUse().double(), cross_entropy, x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_step_runs_on_cuda_with_a_cuda_generator() -> None:
    model, x, y = build("cnn")
    model = model.float().cuda()
    x = x.float().cuda()
    y = y.cuda()
    expected = torch.stack([oracle_norm(g) for g in oracle(model, cross_entropy, x, y)])
    torch.testing.assert_close(per_sample_grad_norms(model, cross_entropy, x, y), expected, rtol=1e-4, atol=1e-5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats_ = dp_sgd_step(
        model,
        cross_entropy,
        x,
        y,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=7.0,
        generator=torch.Generator(device="cuda").manual_seed(0),
        optimizer=optimizer,
    )
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
    with pytest.raises(ValueError, match="generator is on cpu"):
        dp_sgd_step(
            model,
            cross_entropy,
            x,
            y,
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=7.0,
            generator=torch.Generator(),
            optimizer=optimizer,
        )
    assert stats_.batch_size == 7
