"""Throughput of the DP-SGD engine as a Flower silo runs it, against the silo library's own engine.

    python bench/silo_engine_throughput.py [--quick] [--threads N] [--batch-size B] [--records N]

A Flower ClientApp trains its silo half over a one-silo engine (`dpledger.flower.family.one_silo_engine`):
flat parameters in, flat parameters out, the model being the federation's tiny CNN (digits, 8×8). The
library's engine (`dpledger.silo.DPSGDEngine`, the one `bench/dpsgd_throughput.py` times against
Opacus) trains the same module on the same records with the same Poisson sampling rate, one gated
step at a time. Both are timed interleaved, in rounds of `--steps` steps (other load on the machine
only ever adds time, so the best round is the closest to each one's own cost; the median is printed
beside it), and reported as expected records per second (steps × B / seconds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.flower import family
from dpledger.flower.local import template, tiny_cnn
from dpledger.silo import DPSGDEngine
from dpledger.trainer.federated.config import DPSGDConfig

SIGMA, CLIP, LR = 1.0, 1.0, 0.5


class _Unmetered:
    """A permit that covers every step: the bench times the engine, not the ledger."""

    def take(self, *, noise_multiplier: float | None = None, sampling_rate: float | None = None) -> float:
        return SIGMA


def flower_silo(x: torch.Tensor, y: torch.Tensor, *, batch_size: int, steps: int) -> Callable[[], None]:
    config = DPSGDConfig(lr=LR, clip_norm=CLIP, noise_multiplier=SIGMA, batch_size=batch_size, local_steps=steps)
    model = template(seed=0)
    engine = family.one_silo_engine(model, x, y, config)
    params = model.initial().unsqueeze(0)
    rows = torch.tensor([0])

    def run() -> None:
        engine.dp_sgd(params, rows, steps=steps)

    return run


def library(x: torch.Tensor, y: torch.Tensor, *, batch_size: int, steps: int) -> Callable[[], None]:
    model = tiny_cnn()
    engine = DPSGDEngine(
        model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=nn.CrossEntropyLoss(reduction="none"), data=(x, y),
        batch_size=batch_size, max_grad_norm=CLIP, generator=torch.Generator().manual_seed(0),
    )
    permit = _Unmetered()

    def run() -> None:
        for _ in range(steps):
            engine.step(permit)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few seconds (smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a ClientApp trains on 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="B, the job file's default")
    parser.add_argument("--records", type=int, default=674, help="the silo's records (half of digits' training set)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round (E, the job file's default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(args.records, 64, generator=generator)
    y = torch.randint(0, 10, (args.records,), generator=generator)
    runs = {"flower silo": flower_silo(x, y, batch_size=args.batch_size, steps=args.steps),
            "library": library(x, y, batch_size=args.batch_size, steps=args.steps)}
    warmup, rounds = (1, 5) if args.quick else (3, 60)
    for run in runs.values():
        for _ in range(warmup):
            run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():  # interleaved: load on the machine lands on both alike
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    records = args.steps * args.batch_size
    print(f"threads={torch.get_num_threads()} B={args.batch_size} n={args.records} steps/round={args.steps} rounds={rounds}")
    print(f"{'engine':<12} {'records/s best':>15} {'records/s median':>17}")
    rate = {}
    for name, times in seconds.items():
        rate[name] = (records / min(times), records / statistics.median(times))
        print(f"{name:<12} {rate[name][0]:15.0f} {rate[name][1]:17.0f}")
    best, median = (rate["flower silo"][i] / rate["library"][i] for i in (0, 1))
    print(f"flower silo / library: best {best:.3f}, median {median:.3f}")


if __name__ == "__main__":
    main()
