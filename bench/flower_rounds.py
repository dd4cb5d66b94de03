"""Per-round time of a real Flower federation (dpledger serve, a SuperLink, K SuperNodes, `flwr run`
of FedAvg) split into training, ledger and Flower, beside the in-process simulator on the same setting.

    python bench/flower_rounds.py [--silos 3] [--rounds 4] [--steps 2] [--train 120] [--simulation]

Federation: each silo's ClientApp reports its own training seconds and its gate's ledger seconds
(reserve + commit + norm report, over HTTP); "Flower" is the rest of the round as the ServerApp sees
it (messages through the SuperLink, one `flwr-clientapp` process started per message, the model
(de)serialised), taken against the slowest silo: round − max_k(train_k + ledger_k).
`--simulation` also runs the same ClientApp and ServerApp in Flower's simulation engine (Ray, one
virtual node per silo; `flower-superlink --simulation`), split the same way.
Simulator: `trainer.federated.FedAvg` over the same silo files, model, steps, batch size and σ,
every round gated by `run_gated` against the same ledger (new silos), against its ungated
`run_round` on a second copy: ledger = gated − ungated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.flower.local import tiny_cnn
from dpledger.trainer.client import LedgerClient
from dpledger.trainer.federated import FedAvg
from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.loop import GatedSilo, run_gated
from tests.flower.federation import DELTA, Federation, federation

SIGMA, BATCH, LR = 1.0, 16, 0.5


def simulator(paths: list[Path], *, steps: int, seed: int) -> FedAvg:
    files = [np.load(p) for p in paths]
    return FedAvg(
        x_train=[torch.as_tensor(f["x"]) for f in files], y_train=[torch.as_tensor(f["y"]) for f in files],
        x_test=[torch.as_tensor(f["x_test"]) for f in files], y_test=[torch.as_tensor(f["y_test"]) for f in files],
        model=tiny_cnn, num_classes=10,
        config=DPSGDConfig(lr=LR, clip_norm=1.0, noise_multiplier=SIGMA, batch_size=BATCH, local_steps=steps, seed=seed),
    )


Split = tuple[float, float, float, float]  # round, training, ledger, Flower (s)


def flower_split(fed: Federation, folder: Path, args: argparse.Namespace) -> list[Split]:
    """Runs FedAvg on the federation; per round: its wall time at the server, and the slowest silo's
    training and ledger seconds, the rest being Flower's."""
    out = folder / "run.json"
    done = fed.run(timeout=1800, algorithm="fedavg", rounds=args.rounds, **{
        "local-steps": args.steps, "batch-size": BATCH, "lr": LR, "min-nodes": args.silos, "round-timeout": 600.0,
        "ledger-url": fed.ledger_url, "coordinator-key-file": str(fed.coordinator_key_file), "out": str(out)})
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    split = []
    for entry in json.loads(out.read_text())["rounds"]:
        train, ledger = entry["train_seconds"], entry["ledger_seconds"]
        slowest = max(train, key=lambda k: train[k] + ledger[k])
        split.append((entry["seconds"], train[slowest], ledger[slowest], entry["seconds"] - train[slowest] - ledger[slowest]))
    return split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--silos", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--train", type=int, default=120)
    parser.add_argument("--simulation", action="store_true", help="also run Flower's simulation engine (Ray)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    simulated: list[Split] = []
    if args.simulation:
        with tempfile.TemporaryDirectory() as tmp, federation(Path(tmp), budgets=[50.0] * args.silos, noise_multiplier=SIGMA,
                                                               train=args.train, test=40, simulation=True) as fed:
            simulated = flower_split(fed, Path(tmp), args)
    with tempfile.TemporaryDirectory() as tmp, federation(Path(tmp), budgets=[50.0] * args.silos, noise_multiplier=SIGMA,
                                                           train=args.train, test=40) as fed:
        split = flower_split(fed, Path(tmp), args)

        paths = [s.data_file for s in fed.silos]
        gated, free = simulator(paths, steps=args.steps, seed=0), simulator(paths, steps=args.steps, seed=0)
        with fed.ledger() as admin:
            created = [admin.create_silo(name=f"sim-{k}", epsilon=50.0, delta=DELTA, dataset_size=args.train)
                       for k in range(args.silos)]
        silos = [GatedSilo(c.id, LedgerClient(fed.ledger_url, c.api_key)) for c in created]
        gated_times: list[float] = []
        started = time.perf_counter()
        run_gated(gated, silos, rounds=args.rounds, job_id="bench-sim",
                  on_round=lambda _: gated_times.append(time.perf_counter() - started - sum(gated_times)))
        free_times = []
        for r in range(args.rounds):
            t = time.perf_counter()
            free.run_round(r, torch.ones(args.silos, dtype=torch.bool))
            free_times.append(time.perf_counter() - t)

    med = statistics.median
    print(f"{args.silos} silos × {args.train} records, tiny CNN, {args.steps} DP-SGD steps of batch {BATCH} a round, "
          f"{args.rounds} rounds of FedAvg (median per round, s)")
    print(f"{'':24}{'round':>8}{'training':>10}{'ledger':>8}{'Flower':>8}")
    for name, rows in (("Flower federation", split), ("Flower simulation (Ray)", simulated)):
        if rows:
            print(f"{name:24}{med(s[0] for s in rows):8.2f}{med(s[1] for s in rows):10.2f}"
                  f"{med(s[2] for s in rows):8.2f}{med(s[3] for s in rows):8.2f}")
    sim_ledger = med(g - f for g, f in zip(gated_times, free_times, strict=True))
    print(f"{'in-process simulator':24}{med(gated_times):8.2f}{med(free_times):10.2f}{sim_ledger:8.2f}{0.0:8.2f}")
    print(json.dumps({"flower": split, "flower_simulation": simulated, "simulator_gated": gated_times,
                      "simulator_ungated": free_times}))


if __name__ == "__main__":
    main()
