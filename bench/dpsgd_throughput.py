"""Throughput of our DP-SGD step against a non-private step and Opacus' PrivacyEngine.

    python bench/dpsgd_throughput.py [--device cpu|cuda] [--quick] [--threads N]

Prints samples/s for each (model, method), from the best and the median of interleaved rounds
(other load on the machine only ever adds time, so the best is the closest to the method's own
cost), and the ratios ours / non-private and ours / Opacus ghost. Random data, fixed-size batches
(Poisson sampling would only add noise to the timings), the same models and optimizer everywhere.
Opacus rows are skipped if it is not installed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.trainer.silo.dpsgd.step import dp_sgd_step

MAX_GRAD_NORM = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.05


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 28 * 28, 10),
    )


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp 784-512-256-10": mlp, "cnn 1x28x28 c16 c32 l10": cnn}


@dataclass(frozen=True)
class Result:
    model: str
    method: str
    best_per_s: float | None
    median_per_s: float | None
    note: str = ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    steps: dict[str, Callable[[], None]], *, device: torch.device, warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per step of each method, one step of each per round.

    Interleaving spreads any other load on the machine over all methods alike, instead of landing
    on whichever method happened to run during it.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def non_private(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()

    return step


def ours(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss(reduction="none")
    generator = torch.Generator(device=x.device)
    generator.manual_seed(0)

    def step() -> None:
        dp_sgd_step(
            model,
            criterion,
            x,
            y,
            max_grad_norm=MAX_GRAD_NORM,
            noise_multiplier=NOISE_MULTIPLIER,
            expected_batch_size=float(x.shape[0]),
            generator=generator,
            optimizer=optimizer,
        )

    return step


def opacus_step(model: nn.Module, x: Tensor, y: Tensor, *, mode: str) -> Callable[[], None]:
    from opacus import PrivacyEngine  # type: ignore[import-untyped]  # optional dependency, imported lazily

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=x.shape[0])
    engine = PrivacyEngine()
    common = dict(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=MAX_GRAD_NORM,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        private_model, private_optimizer, criterion, _ = engine.make_private(**common, criterion=nn.CrossEntropyLoss())
    else:
        private_model, private_optimizer, _ = engine.make_private(**common)
        criterion = nn.CrossEntropyLoss()

    def step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        criterion(private_model(x), y).backward()
        private_optimizer.step()

    return step


def run(*, device: torch.device, batch_size: int, warmup: int, rounds: int) -> list[Result]:
    try:
        import opacus  # noqa: F401

        opacus_modes = ["hooks", "ghost"]
    except ImportError:
        opacus_modes = []
    results: list[Result] = []
    for model_name, factory in MODELS.items():
        torch.manual_seed(0)
        template = factory().to(device)
        x = torch.randn(batch_size, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        steps = {
            "non-private SGD": non_private(copy.deepcopy(template), x, y),
            "ours DP-SGD": ours(copy.deepcopy(template), x, y),
        }
        for mode in opacus_modes:
            steps[f"opacus {mode}"] = opacus_step(copy.deepcopy(template), x, y, mode=mode)
        for method, seconds in time_interleaved(steps, device=device, warmup=warmup, rounds=rounds).items():
            results.append(
                Result(model_name, method, batch_size / min(seconds), batch_size / statistics.median(seconds))
            )
        if not opacus_modes:
            results.append(Result(model_name, "opacus", None, None, "not installed: skipped"))
    return results


def print_table(results: list[Result]) -> None:
    print(f"{'model':<26} {'method':<18} {'samples/s best':>15} {'samples/s median':>17}")
    for r in results:
        if r.best_per_s is None or r.median_per_s is None:
            print(f"{r.model:<26} {r.method:<18} {'-':>15} {'-':>17} {r.note}")
            continue
        print(f"{r.model:<26} {r.method:<18} {r.best_per_s:15.0f} {r.median_per_s:17.0f}")
    print()
    for model_name in MODELS:
        for label in ("best", "median"):
            rate = {
                r.method: (r.best_per_s if label == "best" else r.median_per_s)
                for r in results
                if r.model == model_name and r.best_per_s is not None and r.median_per_s is not None
            }
            ours_rate = rate["ours DP-SGD"]
            line = f"{model_name:<26} {label:<6} ours/non-private = {ours_rate / rate['non-private SGD']:.2f}"
            if "opacus ghost" in rate:
                line += f"   ours/opacus-ghost = {ours_rate / rate['opacus ghost']:.2f}"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a few seconds: small batch, few iterations (smoke test)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # Opacus warns about secure RNG and about the optimizer it wraps; neither matters for timing.
    warnings.filterwarnings("ignore")
    if args.quick:
        results = run(device=device, batch_size=32, warmup=1, rounds=2)
    else:
        results = run(device=device, batch_size=256, warmup=2, rounds=10)
    print(f"device={device} threads={torch.get_num_threads()} quick={args.quick}")
    print_table(results)


if __name__ == "__main__":
    main()
