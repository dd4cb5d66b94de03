"""Time per round of the gated demo, and batched vs per-silo-loop training, as K grows.

    python bench/demo_rounds.py                      # K = 10, 50, 200; 3 timed rounds (~5-8 min on 2 cores)
    python bench/demo_rounds.py --silos 10,50 --rounds 5
    python bench/demo_rounds.py --quick              # K = 4, 8; 1 timed round, 1 thread only (< 60 s)

For each K (one fresh ledger on a temp SQLite file per K, uvicorn in a child process via
`dpledger.harness.running_server`), and for each torch thread configuration (1 thread, then torch's
default), one run measures:

1. The gated demo round as `dpledger.demo` runs it for MR-MTL (the demo's λ): rotated & masked digits
   (p = 0.1), MixGauss1 budgets, each silo's σ calibrated through the service to its budget rounded
   down to 2 significant digits (so silos share calibrations, ~1 s each; σ only grows) for
   1 + `--rounds` rounds, so no silo is refused; then `trainer.loop.run_gated`: per round each silo's
   mechanism is reserved over HTTP, the batched round runs, each charge is committed over HTTP, the
   K models are evaluated. Its wall time per round is split into ledger (reserve + commit calls,
   timed around the `LedgerClient` methods run_gated calls), training (`run_round`), evaluation
   (`evaluate`) and the rest (mechanism declaration, bookkeeping).
2. The training of one round, batched vs naive: `LocalTraining` on all K silos in one batched
   computation ([K, P] parameters, vmap over silos) against a Python loop over K one-silo
   `LocalTraining` objects, each built on that silo's data alone, with the same config and σ_k.
   LocalTraining rather than MR-MTL, because MR-MTL's pull towards the mean of all K models makes a
   one-silo MR-MTL object a different algorithm (its mean is its own model, so the regulariser
   vanishes); LocalTraining does the same per-silo work either way. (A one-silo object draws its
   batches and noise from the streams of "silo 0", so the draws differ from the batched run's; the
   expected work is the same.) Batched and loop rounds are interleaved (batched r, loop r, batched
   r+1, ...) so machine drift falls on both.
3. Growth with K: every time is also given per silo (ms / silo), and as a factor over the smallest K.

Round 0 is a warm-up (first vmap traces, the ledger's first RDP curve per (q, σ) pair, connection
setup) and is not timed; the figures are medians over the `--rounds` timed rounds.

With 1,797 digits, K = 200 leaves each silo ~9 records, ~6-7 of them for training (every record is
then sampled, q = 1): fine for timing, meaningless for accuracy. The server shares the machine's cores
with this process; while training runs the server is idle, and while the ledger answers training is
idle, so they do not compete within a round. Other processes may: each configuration also reports
the cores that processes outside this bench kept busy meanwhile (psutil); on a shared 2-core
machine that load hits torch's default 2 threads much harder than 1 thread.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from dpledger.demo import DemoConfig
from dpledger.harness import running_server
from dpledger.trainer.data.budgets import draw_budgets
from dpledger.trainer.data.digits import make_rotated_masked_digits
from dpledger.trainer.federated import MRMTL, DPSGDConfig, LocalTraining
from dpledger.trainer.loop import GatedSilo, RoundRecord, run_gated
from dpledger.wire.client import LedgerClient

from _harness import OtherLoad, log

CALIBRATION_DIGITS = 2


# --------------------------------------------------------------------------------------------------
# Timers around what run_gated calls


class Stopwatch:
    """Accumulated seconds and call counts per label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def time(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
            self.calls[label] = self.calls.get(label, 0) + 1

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)

    def wrap(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.time(label):
                return function(*args, **kwargs)

        return timed


class TimedClient(LedgerClient):
    """A silo's LedgerClient whose approval and settlement calls are timed (HTTP round trip,
    server work and client-side JSON included)."""

    def __init__(self, base_url: str, api_key: str, *, watch: Stopwatch) -> None:
        super().__init__(base_url, api_key)
        self._watch = watch

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        with self._watch.time("ledger"):
            return super().reserve(*args, **kwargs)

    def commit(self, charge_id: int) -> float | None:
        with self._watch.time("ledger"):
            return super().commit(charge_id)

    def release(self, charge_id: int) -> float | None:
        with self._watch.time("ledger"):
            return super().release(charge_id)


# --------------------------------------------------------------------------------------------------
# Measurements


@dataclass
class Cell:
    """One (K, threads) configuration: per timed round, seconds of each part."""

    silos: int
    threads: int
    train_sizes: list[int]
    gated: dict[str, list[float]] = field(default_factory=dict)  # round, ledger, train, eval, other
    requests_per_round: float = 0.0
    refused: int = 0
    batched: list[float] = field(default_factory=list)  # LocalTraining, batched, s / round
    loop: list[float] = field(default_factory=list)  # LocalTraining, K one-silo objects, s / round
    other_gated: float = math.nan  # cores used by other processes during the gated run
    other_training: float = math.nan  # ... and during batched vs loop

    def med(self, values: list[float]) -> float:
        return statistics.median(values)


def gated_rounds(
    *, url: str, admin: LedgerClient, dataset: Any, budgets: list[float], noise: list[float], demo: DemoConfig,
    dpsgd: DPSGDConfig, rounds: int, tag: str, cell: Cell,
) -> None:
    """run_gated on MR-MTL for 1 + rounds rounds; records the timed rounds' split into `cell`."""
    watch = Stopwatch()
    algorithm = MRMTL(
        lam=demo.lam,
        **dataset.tensors(),
        num_classes=dataset.n_classes, config=dpsgd, noise_multipliers=noise, device=demo.device,
    )
    # Instance attributes shadow the methods, so run_gated's calls go through the timers.
    run_round = algorithm.run_round

    def run_round_synchronized(*args: Any) -> Any:
        result = run_round(*args)
        synchronize(demo.device)
        return result

    algorithm.run_round = watch.wrap("train", run_round_synchronized)  # type: ignore[method-assign]  # timed on this instance only
    algorithm.evaluate = watch.wrap("eval", algorithm.evaluate)  # type: ignore[method-assign]  # timed on this instance only
    created = [
        admin.create_silo(name=f"{tag}-silo-{k}", epsilon=budgets[k], delta=demo.delta, dataset_size=s.n_train)
        for k, s in enumerate(dataset.silos)
    ]
    gated = [GatedSilo(s.id, TimedClient(url, s.api_key, watch=watch)) for s in created]
    marks: list[tuple[float, dict[str, float], dict[str, int]]] = []

    def on_round(_: RoundRecord) -> None:
        marks.append((time.perf_counter(), *watch.snapshot()))

    try:
        start = (time.perf_counter(), *watch.snapshot())
        run = run_gated(algorithm, gated, rounds=1 + rounds, job_id=tag, on_round=on_round)
    finally:
        for silo in gated:
            silo.client.close()
    if len(run.rounds) != 1 + rounds:
        raise RuntimeError(f"{tag}: ran {len(run.rounds)} rounds of {1 + rounds}: {run.stop_reason}")
    cell.refused = sum(run.refused_rounds())
    bounds = [start, *marks]
    parts: dict[str, list[float]] = {name: [] for name in ("round", "ledger", "train", "eval", "other")}
    requests = []
    for (t0, s0, c0), (t1, s1, c1) in list(itertools.pairwise(bounds))[1:]:  # drop the warm-up round
        seconds = {label: s1.get(label, 0.0) - s0.get(label, 0.0) for label in ("ledger", "train", "eval")}
        parts["round"].append(t1 - t0)
        for label, value in seconds.items():
            parts[label].append(value)
        parts["other"].append(t1 - t0 - sum(seconds.values()))
        requests.append(c1.get("ledger", 0) - c0.get("ledger", 0))
    cell.gated = parts
    cell.requests_per_round = statistics.mean(requests)


def batched_vs_loop(*, dataset: Any, noise: list[float], dpsgd: DPSGDConfig, demo: DemoConfig, rounds: int, cell: Cell) -> None:
    """LocalTraining rounds: all K silos batched vs a loop over K one-silo objects, interleaved."""
    xs_tr = [s.x_train for s in dataset.silos]
    ys_tr = [s.y_train for s in dataset.silos]
    xs_te = [s.x_test for s in dataset.silos]
    ys_te = [s.y_test for s in dataset.silos]
    common = dict(num_classes=dataset.n_classes, config=dpsgd, device=demo.device)
    batched = LocalTraining(x_train=xs_tr, y_train=ys_tr, x_test=xs_te, y_test=ys_te, noise_multipliers=noise, **common)
    singles = [
        LocalTraining(x_train=[xs_tr[k]], y_train=[ys_tr[k]], x_test=[xs_te[k]], y_test=[ys_te[k]],
                      noise_multipliers=[noise[k]], **common)
        for k in range(len(dataset.silos))
    ]
    everyone = torch.ones(batched.num_silos, dtype=torch.bool)
    one = torch.ones(1, dtype=torch.bool)
    for r in range(1 + rounds):
        t0 = time.perf_counter()
        batched.run_round(r, everyone)
        synchronize(demo.device)
        t1 = time.perf_counter()
        for single in singles:
            single.run_round(r, one)
        synchronize(demo.device)
        t2 = time.perf_counter()
        if r > 0:  # round 0 is the warm-up
            cell.batched.append(t1 - t0)
            cell.loop.append(t2 - t1)


def synchronize(device: str) -> None:
    # CUDA kernels run asynchronously: a timer read before they finish would time only the launches.
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_k(k: int, *, rounds: int, thread_configs: list[int], seed: int, device: str) -> list[Cell]:
    demo = DemoConfig(silos=k, rounds=1 + rounds, seed=seed, progress=False, device=device)
    dataset = make_rotated_masked_digits(n_silos=k, seed=seed, mask_probability=demo.mask_probability)
    budgets = [float(e) for e in draw_budgets("MixGauss1", n_silos=k, seed=seed).epsilons]
    dpsgd = DPSGDConfig(seed=seed)
    admin_key = secrets.token_urlsafe(32)
    sizes = [s.n_train for s in dataset.silos]
    cells = []
    with tempfile.TemporaryDirectory(prefix="dpledger-bench-") as tmp, running_server(
        database_url=f"sqlite:///{tmp}/ledger.db", admin_key=admin_key
    ) as url, LedgerClient(url, admin_key) as admin:
        t = time.perf_counter()
        noise = calibrated_noise(admin, dataset, budgets, dpsgd=dpsgd, rounds=1 + rounds, delta=demo.delta)
        log(f"K={k}: calibrated {k} silos' σ in {time.perf_counter() - t:.1f} s")
        for threads in thread_configs:
            torch.set_num_threads(threads)
            cell = Cell(silos=k, threads=threads, train_sizes=sizes)
            t = time.perf_counter()
            with OtherLoad() as load:
                gated_rounds(url=url, admin=admin, dataset=dataset, budgets=budgets, noise=noise, demo=demo,
                             dpsgd=dpsgd, rounds=rounds, tag=f"bench-k{k}-t{threads}", cell=cell)
            cell.other_gated = load.cores
            log(f"K={k} threads={threads}: gated MR-MTL, 1+{rounds} rounds in {time.perf_counter() - t:.1f} s")
            t = time.perf_counter()
            with OtherLoad() as load:
                batched_vs_loop(dataset=dataset, noise=noise, dpsgd=dpsgd, demo=demo, rounds=rounds, cell=cell)
            cell.other_training = load.cores
            log(f"K={k} threads={threads}: batched vs loop, 1+{rounds} rounds in {time.perf_counter() - t:.1f} s")
            cells.append(cell)
    return cells


def round_down(value: float, digits: int = CALIBRATION_DIGITS) -> float:
    """`value` rounded down to `digits` significant digits (never above `value`)."""
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return min(value, math.floor(value / scale) * scale)


def calibrated_noise(admin: LedgerClient, dataset: Any, budgets: list[float], *, dpsgd: DPSGDConfig, rounds: int,
                     delta: float) -> list[float]:
    """σ_k so that `rounds` rounds cost at most silo k's budget, as dpledger.demo calibrates them, except
    that ε_k is first rounded down to CALIBRATION_DIGITS significant digits so that silos share
    calibrations (one costs the service ~1 s; K = 200 exact budgets would take minutes). Rounding
    down only raises σ_k, so no silo is refused; the timed rounds are unaffected either way (after the
    warm-up round every (q, σ) pair's RDP curve is in the service's cache)."""
    cache: dict[tuple[float, float], float] = {}
    noise = []
    for budget, silo in zip(budgets, dataset.silos, strict=True):
        epsilon = round_down(budget)
        q = min(dpsgd.batch_size, silo.n_train) / silo.n_train
        if (epsilon, q) not in cache:
            cache[(epsilon, q)] = admin.calibrate(epsilon=epsilon, delta=delta, sampling_rate=q,
                                                  steps=rounds * dpsgd.local_steps)
        noise.append(cache[(epsilon, q)])
    return noise


# --------------------------------------------------------------------------------------------------
# Report


def table(cells: list[Cell], ks: list[int], thread_configs: list[int], default_threads: int) -> str:
    by = {(c.silos, c.threads): c for c in cells}
    width = 12
    head_k = "".join(f"{f'K={k}':>{width}}" for k in ks)
    label_w = 44
    lines: list[str] = []

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<{label_w}}" + "".join(f"{v:>{width}}" for v in values))

    def each(threads: int, f: Callable[[Cell], float], fmt: str) -> list[str]:
        return [format(f(by[(k, threads)]), fmt) for k in ks]

    sizes = [by[(k, thread_configs[0])].train_sizes for k in ks]
    lines.append(f"{'':<{label_w}}{head_k}")
    row("train records / silo (min-median-max)",
        [f"{min(s)}-{int(statistics.median(s))}-{max(s)}" for s in sizes])
    row("ledger requests / round (reserve+commit)", [f"{by[(k, thread_configs[0])].requests_per_round:.0f}" for k in ks])
    for threads in thread_configs:
        name = f"torch threads = {threads}" + (" (default)" if threads == default_threads else "")
        lines.append("")
        lines.append(f"-- {name}; medians of the timed rounds --")
        row(
            "other processes' load, cores (1. / 2.)",
            [f"{by[(k, threads)].other_gated:.1f} / {by[(k, threads)].other_training:.1f}" for k in ks],
        )
        lines.append("1. gated MR-MTL demo round (s / round)")
        row("   whole round", each(threads, lambda c: c.med(c.gated["round"]), ".3f"))
        row("     ledger: approvals + commits over HTTP", each(threads, lambda c: c.med(c.gated["ledger"]), ".3f"))
        row("     training: batched run_round", each(threads, lambda c: c.med(c.gated["train"]), ".3f"))
        row("     evaluation", each(threads, lambda c: c.med(c.gated["eval"]), ".4f"))
        row("     other (declare mechanisms, records)", each(threads, lambda c: c.med(c.gated["other"]), ".4f"))
        row("   ledger share of the round", each(threads, lambda c: c.med(c.gated["ledger"]) / c.med(c.gated["round"]), ".0%"))
        row("   ledger ms / request", each(threads, lambda c: 1e3 * c.med(c.gated["ledger"]) / c.requests_per_round, ".2f"))
        lines.append("2. one round's training, LocalTraining (s / round)")
        row("   batched (one vmap over K silos)", each(threads, lambda c: c.med(c.batched), ".4f"))
        row("   loop over K one-silo objects", each(threads, lambda c: c.med(c.loop), ".4f"))
        row("   loop / batched", each(threads, lambda c: c.med(c.loop) / c.med(c.batched), ".1f"))
        lines.append("3. per silo (ms / silo / round)")
        row("   whole gated round", each(threads, lambda c: 1e3 * c.med(c.gated["round"]) / c.silos, ".2f"))
        row("   ledger", each(threads, lambda c: 1e3 * c.med(c.gated["ledger"]) / c.silos, ".2f"))
        row(
            "   MR-MTL training, batched (in the gated round)",
            each(threads, lambda c: 1e3 * c.med(c.gated["train"]) / c.silos, ".3f"),
        )
        row("   LocalTraining, batched", each(threads, lambda c: 1e3 * c.med(c.batched) / c.silos, ".3f"))
        row("   LocalTraining, loop", each(threads, lambda c: 1e3 * c.med(c.loop) / c.silos, ".3f"))
        base = by[(ks[0], threads)]
        lines.append(f"   growth over K={ks[0]} (K factor: " + ", ".join(f"{k / ks[0]:g}x" for k in ks) + ")")
        row(
            "     whole gated round",
            each(threads, lambda c, base=base: c.med(c.gated["round"]) / base.med(base.gated["round"]), ".2f"),
        )
        row("     ledger", each(threads, lambda c, base=base: c.med(c.gated["ledger"]) / base.med(base.gated["ledger"]), ".2f"))
        row(
            "     MR-MTL training, batched",
            each(threads, lambda c, base=base: c.med(c.gated["train"]) / base.med(base.gated["train"]), ".2f"),
        )
        row("     LocalTraining, batched", each(threads, lambda c, base=base: c.med(c.batched) / base.med(base.batched), ".2f"))
        row("     LocalTraining, loop", each(threads, lambda c, base=base: c.med(c.loop) / base.med(base.loop), ".2f"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--silos", default="10,50,200", help="comma-separated K values (default 10,50,200)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after 1 warm-up round (default 3)")
    parser.add_argument("--threads", default=None,
                        help="torch thread configurations, comma-separated integers or 'default' "
                             "(default: 1,default; with --quick: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--quick", action="store_true", help="K = 4, 8; 1 timed round; 1 thread only (< 60 s)")
    args = parser.parse_args()

    default_threads = torch.get_num_threads()
    ks = [4, 8] if args.quick else [int(k) for k in args.silos.split(",")]
    rounds = 1 if args.quick else args.rounds
    if rounds < 1 or not ks or min(ks) < 1:
        parser.error("need at least one timed round and K >= 1")
    thread_configs: list[int] = []
    threads = args.threads if args.threads is not None else ("1" if args.quick else "1,default")
    for item in threads.split(","):
        n = default_threads if item.strip() == "default" else int(item)
        if n not in thread_configs:
            thread_configs.append(n)

    log(f"K in {ks}, 1 warm-up + {rounds} timed rounds, torch threads {thread_configs} (default {default_threads}), "
        f"torch {torch.__version__}, device {args.device}")
    cells: list[Cell] = []
    for k in ks:
        cells.extend(measure_k(k, rounds=rounds, thread_configs=thread_configs, seed=args.seed, device=args.device))
    torch.set_num_threads(default_threads)

    print(f"dpledger demo rounds: MR-MTL (λ={DemoConfig.lam:g}) on rotated & masked digits (p=0.1), MixGauss1 budgets, "
          f"σ_k calibrated; SQLite ledger, uvicorn 1 worker, real HTTP; DP-SGD B=16, E=10 steps/round, "
          f"mlp 64-32-10; {args.device}, torch {torch.__version__}; 1 warm-up + {rounds} timed round(s)")
    print(table(cells, ks, thread_configs, default_threads))
    refused = sum(c.refused for c in cells)
    largest = max(cells, key=lambda c: c.silos)
    n_median = int(statistics.median(largest.train_sizes))
    sampling = (
        "q = 1: every record in every batch"
        if max(largest.train_sizes) <= DPSGDConfig().batch_size
        else f"q ≈ {DPSGDConfig().batch_size / n_median:.2f}"
    )
    print(f"notes: silo-rounds refused by the ledger: {refused}. Section 2 compares LocalTraining, not MR-MTL (a one-silo "
          f"MR-MTL object is not the same algorithm: its mean is its own model). With K={largest.silos} each silo has "
          f"~{n_median} training records ({sampling}): fine for timing, not for accuracy. Other processes' load: "
          f"cores busy outside this bench during the measurement (the machine may be shared; {os.cpu_count()} cores).")
    summary = {
        "rounds": rounds,
        "default_threads": default_threads,
        "cells": [
            {
                "silos": c.silos, "threads": c.threads, "requests_per_round": c.requests_per_round,
                **{f"gated_{name}_s": c.med(values) for name, values in c.gated.items()},
                "local_batched_s": c.med(c.batched), "local_loop_s": c.med(c.loop),
                "loop_over_batched": c.med(c.loop) / c.med(c.batched),
                "other_cores_gated": c.other_gated, "other_cores_training": c.other_training,
            }
            for c in cells
        ],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
