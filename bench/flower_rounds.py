"""Per-round time of a real Flower federation (dpledger serve, a SuperLink, K SuperNodes, `flwr run`
of FedAvg) split into training, ledger and Flower, beside the in-process simulator on the same setting.

    python bench/flower_rounds.py [--silos 3] [--rounds 4] [--steps 2] [--train 120] [--isolation process]
                                  [--simulation] [--no-simulator]

Federation: each silo's ClientApp reports its own training seconds and its gate's ledger seconds
(reserve + commit + norm report, over HTTP); "Flower" is the rest of the round as the ServerApp sees
it, taken against the slowest silo: round − max_k(train_k + ledger_k). The launch is
tests/flower/federation.py's (`--isolation process`: a `flower-superexec` of ours beside each
SuperNode, polling for tasks every FLWR_SUPEREXEC_TASK_POLL_INTERVAL s; set it to 1 for Flower's
default). Where Flower's time goes, per message (Flower 1.41, hard-coded unless said):
- the SuperNode asks the SuperLink for a message every 3 s while idle, and it goes idle right after
  each reply: the next round's message waits ~3 s at the slowest silo whatever else is done;
- `Grid.send_and_receive` (in the ServerApp) pulls replies every 3 s: a round lasts a multiple of 3 s;
- the SuperExec asks for a task every FLWR_SUPEREXEC_TASK_POLL_INTERVAL s (1 s by default);
- a fresh `flwr-clientapp` process per message, which imports Flower, torch and the app: the
  "ClientApp start" line times that import, one process per silo at once, as the SuperNodes do;
- the SuperNode looks for the ClientApp's reply every 0.5 s.
`--simulation` also runs the same ClientApp and ServerApp in Flower's simulation engine (Ray, one
virtual node per silo; `flower-superlink --simulation`), split the same way.
Simulator: `trainer.federated.FedAvg` over the same silo files, model, steps, batch size and σ,
every round gated by `run_gated` against the same ledger (new silos), against its ungated
`run_round` on a second copy: ledger = gated − ungated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpledger.flower.local import tiny_cnn
from dpledger.trainer.federated import FedAvg
from dpledger.trainer.federated.config import DPSGDConfig
from dpledger.trainer.loop import GatedSilo, run_gated
from dpledger.wire.client import LedgerClient
from tests.flower.federation import DELTA, ISOLATION, SUPEREXEC_POLL_SECONDS, Federation, federation

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
    done = fed.run(limit=1800, algorithm="fedavg", rounds=args.rounds, **{
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


def clientapp_start(silos: int, *, repeats: int = 3) -> list[float]:
    """Seconds until the last of `silos` fresh processes, started at once, has imported what a
    `flwr-clientapp` imports before it can run our ClientApp (Flower's runtime, then the app)."""
    code = "import flwr.supernode.cli.flwr_clientapp, dpledger.flower.client_app"
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        processes = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(silos)]
        if any(p.wait() != 0 for p in processes):
            raise SystemExit("importing the ClientApp failed")
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--silos", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--train", type=int, default=120)
    parser.add_argument("--isolation", choices=("process", "subprocess"), default=ISOLATION,
                        help="the SuperNodes' --isolation (process: a flower-superexec of ours per SuperNode)")
    parser.add_argument("--simulation", action="store_true", help="also run Flower's simulation engine (Ray)")
    parser.add_argument("--no-simulator", action="store_true", help="skip the in-process simulator")
    args = parser.parse_args()
    torch.set_num_threads(1)
    poll = os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(SUPEREXEC_POLL_SECONDS))
    simulated: list[Split] = []
    if args.simulation:
        with tempfile.TemporaryDirectory() as tmp, federation(Path(tmp), budgets=[50.0] * args.silos, noise_multiplier=SIGMA,
                                                               train=args.train, test=40, simulation=True) as fed:
            simulated = flower_split(fed, Path(tmp), args)
    with tempfile.TemporaryDirectory() as tmp, federation(Path(tmp), budgets=[50.0] * args.silos, noise_multiplier=SIGMA,
                                                           train=args.train, test=40, isolation=args.isolation) as fed:
        split = flower_split(fed, Path(tmp), args)
        gated_times: list[float] = []
        free_times: list[float] = []
        if not args.no_simulator:
            gated_times, free_times = in_process(fed, args)
    start = clientapp_start(args.silos)

    med = statistics.median
    print(f"{args.silos} silos × {args.train} records, tiny CNN, {args.steps} DP-SGD steps of batch {BATCH} a round, "
          f"{args.rounds} rounds of FedAvg (median per round, s); SuperNodes: --isolation {args.isolation}, "
          f"SuperExec task poll {poll} s")
    print(f"{'':24}{'round':>8}{'training':>10}{'ledger':>8}{'Flower':>8}")
    for name, rows in (("Flower federation", split), ("Flower simulation (Ray)", simulated)):
        if rows:
            print(f"{name:24}{med(s[0] for s in rows):8.2f}{med(s[1] for s in rows):10.2f}"
                  f"{med(s[2] for s in rows):8.2f}{med(s[3] for s in rows):8.2f}")
    if gated_times:
        sim_ledger = med(g - f for g, f in zip(gated_times, free_times, strict=True))
        print(f"{'in-process simulator':24}{med(gated_times):8.2f}{med(free_times):10.2f}{sim_ledger:8.2f}{0.0:8.2f}")
    print(f"ClientApp start ({args.silos} at once, part of Flower's time): {med(start):.2f} s")
    print(json.dumps({"isolation": args.isolation, "superexec_poll": float(poll), "flower": split,
                      "flower_simulation": simulated, "simulator_gated": gated_times, "simulator_ungated": free_times,
                      "clientapp_start": start}))


def in_process(fed: Federation, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The in-process simulator's rounds on the federation's silo files, gated by its ledger, and ungated."""
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
    free_times: list[float] = []
    for r in range(args.rounds):
        t = time.perf_counter()
        free.run_round(r, torch.ones(args.silos, dtype=torch.bool))
        free_times.append(time.perf_counter() - t)
    return gated_times, free_times


if __name__ == "__main__":
    main()
