"""Per-round time of the gated silo worker on a small CNN, against Opacus (hooks and ghost) on the
same model and batch size, and the gate's share of the round.

    python bench/gated_round.py [--device cpu|cuda] [--steps 10] [--repeats 7] [--threads N]

A round is `--steps` DP-SGD steps of batch 64 (expected) on 28×28 images through
conv16-GroupNorm-conv32-GroupNorm-linear. "gated worker" is `RoundGate.round` around `DPSGDEngine`
steps, against a real ledger (uvicorn on SQLite, over HTTP): reserve, the steps (Poisson sampling,
ghost-norm clipping, one noise draw each), commit. "engine" is the same steps with no ledger.
"opacus hooks" and "opacus ghost" are Opacus' PrivacyEngine with that grad_sample_mode on fixed-size
batches of 64 and no ledger. Methods are interleaved, in a rotated order each repeat; the median
and the best of `--repeats` rounds are printed (load on a shared machine only adds time), with the gate's share
(gated round − its body) / gated round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.harness import running_server
from dpledger.trainer.silo.dpsgd.engine import DPSGDEngine
from dpledger.trainer.silo.gate import RoundGate
from dpledger.wire.client import LedgerClient

N, BATCH, SIGMA, CLIP, LR = 4096, 64, 1.0, 1.0, 0.05
ADMIN_KEY = "bench-gated-round-admin-key-0123456789"


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


def per_example_loss(output: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(output, y, reduction="none")


class Unmetered:
    """A permit that covers every step: the engine's cost without a ledger."""

    def take(self, *, noise_multiplier: float | None = None, sampling_rate: float | None = None) -> float:
        return SIGMA


def make_engine(data: tuple[Tensor, Tensor], device: torch.device) -> DPSGDEngine:
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    return DPSGDEngine(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=per_example_loss, data=data,
                       batch_size=BATCH, max_grad_norm=CLIP, generator=torch.Generator(device).manual_seed(0))


def opacus_round(data: tuple[Tensor, Tensor], device: torch.device, *, mode: str, steps: int) -> Callable[[], None]:
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    model = SmallCNN().to(device)
    x, y = data[0][:BATCH].to(device), data[1][:BATCH].to(device)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=BATCH)
    engine = PrivacyEngine(accountant="rdp")
    common = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
                  noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode)
    if mode == "ghost":
        private, optimizer, criterion, _ = engine.make_private(**common, criterion=nn.CrossEntropyLoss())
    else:
        private, optimizer, _ = engine.make_private(**common)
        criterion = nn.CrossEntropyLoss()

    def run() -> None:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            criterion(private(x), y).backward()
            optimizer.step()

    return run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(1)
    data = (torch.randn(N, 1, 28, 28, generator=generator), torch.randint(0, 10, (N,), generator=generator))

    times: dict[str, list[float]] = {"gated worker": [], "gate (reserve + commit)": [], "engine": [],
                                     "opacus hooks": [], "opacus ghost": []}
    with tempfile.TemporaryDirectory() as tmp, running_server(database_url=f"sqlite:///{tmp}/l.db", admin_key=ADMIN_KEY) as url:
        with LedgerClient(url, ADMIN_KEY) as admin:
            silo = admin.create_silo(name="bench", epsilon=1e4, delta=1e-5, dataset_size=N)
        client = LedgerClient(url, silo.api_key)
        gated, free = make_engine(data, device), make_engine(data, device)
        gate = RoundGate(client, silo_id=silo.id, sampler=gated.sampler)
        rounds: dict[str, Callable[[], None]] = {
            "opacus hooks": opacus_round(data, device, mode="hooks", steps=args.steps),
            "opacus ghost": opacus_round(data, device, mode="ghost", steps=args.steps),
        }
        def gated_round() -> dict[str, float]:
            synchronize(device)
            start = time.perf_counter()
            with gate.round(steps=args.steps, noise_multiplier=SIGMA) as permit:
                body_start = time.perf_counter()
                for _ in range(args.steps):
                    gated.step(permit)
                synchronize(device)
                body = time.perf_counter() - body_start
            total = time.perf_counter() - start
            return {"gated worker": total, "gate (reserve + commit)": total - body}

        def timed(name: str, run: Callable[[], None]) -> Callable[[], dict[str, float]]:
            def measure() -> dict[str, float]:
                start = time.perf_counter()
                run()
                synchronize(device)
                return {name: time.perf_counter() - start}

            return measure

        def free_round() -> None:
            for _ in range(args.steps):
                free.step(Unmetered())

        rounds["engine"] = free_round
        methods = [gated_round, *(timed(name, run) for name, run in rounds.items())]
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            # A different order each repeat, so that no method always runs after the same one.
            order = methods[repeat % len(methods):] + methods[: repeat % len(methods)]
            measured: dict[str, float] = {}
            for method in order:
                measured.update(method())
            if repeat == 0:
                continue
            for name, seconds in measured.items():
                times[name].append(seconds)
        client.close()

    print(f"device {device}, {args.steps} steps of batch {BATCH} per round, {args.repeats} rounds, "
          f"threads {torch.get_num_threads()}")
    print(f"{'method':<26}{'median ms':>11}{'best ms':>10}")
    for name, values in times.items():
        print(f"{name:<26}{1000 * statistics.median(values):>11.1f}{1000 * min(values):>10.1f}")
    gated_median = statistics.median(times["gated worker"])
    share = statistics.median([g / t for g, t in zip(times["gate (reserve + commit)"], times["gated worker"], strict=True)])
    print(f"gate's share of a gated round (median): {100 * share:.1f}%")
    for name in ("opacus hooks", "opacus ghost"):
        print(f"gated worker / {name} (medians): {gated_median / statistics.median(times[name]):.2f}")


if __name__ == "__main__":
    main()
