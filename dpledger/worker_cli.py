"""The worker's commands: `dpledger demo`, `dpledger train` and `dpledger tune`."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from dpledger.demo import DemoConfig, run_demo


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dpledger")
    commands = parser.add_subparsers(required=True, metavar="command")

    demo = commands.add_parser("demo", help="run the end-to-end demo on a temporary SQLite ledger")
    demo.add_argument("--silos", type=int, default=10, help="number of digits silos K (default 10)")
    demo.add_argument("--rounds", type=int, default=20, help="rounds R (default 20)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", type=Path, default=Path("dpledger-report"), help="report folder")
    demo.add_argument("--mixture", default="MixGauss1", choices=["MixGauss1", "MixGauss2", "MixGauss3"])
    demo.add_argument("--lam", type=float, default=1.0, help="MR-MTL λ")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(run=_demo)

    train = commands.add_parser("train", help="run a configured job against any ledger URL")
    train.add_argument("config", type=Path, nargs="?", help="a TOML file (see README)")
    train.add_argument("--url", help="the ledger's base URL")
    train.add_argument("--algorithm", choices=["local", "fedavg", "mrmtl", "ditto", "ppsgd", "finetune", "ifca", "ifca_mrmtl"])
    train.add_argument("--rounds", type=int)
    train.add_argument("--job-id", help="a name for the run (made unique per run), or with --resume the run to continue")
    train.add_argument("--resume", action="store_true", help="continue the run --job-id names: its committed rounds are skipped")
    train.add_argument("--device", default=None)
    train.set_defaults(run=_train)

    tune = commands.add_parser("tune", help="privately tune MR-MTL's λ with a ledger-drawn number of trials")
    tune.add_argument("--grid", default="0,0.1,1,10", help="comma-separated λ values (default 0,0.1,1,10)")
    tune.add_argument("--silos", type=int, default=4)
    tune.add_argument("--rounds", type=int, default=3, help="rounds of each trial's MR-MTL run")
    tune.add_argument("--mean-trials", type=float, default=3.0, help="E[K]")
    tune.add_argument("--distribution", default="geometric",
                      choices=["poisson", "geometric", "logarithmic", "truncated_negative_binomial"])
    tune.add_argument("--shape", type=float, default=None, help="η of truncated_negative_binomial")
    tune.add_argument("--epsilon", type=float, default=20.0, help="each silo's budget ε")
    tune.add_argument("--delta", type=float, default=1e-5)
    tune.add_argument("--noise-multiplier", type=float, default=1.0)
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--url", help="a running ledger (admin key in DPLEDGER_ADMIN_KEY); default: a temporary one")
    tune.add_argument("--device", default=None)
    tune.set_defaults(run=_tune)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def default_device(requested: str | None) -> str:
    import torch

    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def _demo(args: argparse.Namespace) -> None:
    config = DemoConfig(
        silos=args.silos, rounds=args.rounds, seed=args.seed, out=args.out, mixture=args.mixture, lam=args.lam,
        device=default_device(args.device), progress=not args.no_progress,
    )
    table = run_demo(config)
    print(table)
    print(f"\nreport: {config.out}/ (metrics.jsonl, accuracy.png, epsilon.png, table.txt)")


def _train(args: argparse.Namespace) -> int:
    from dpledger.trainer.job import JobConfig, run_job
    from dpledger.trainer.loop import RegisteredSizeError

    settings: dict[str, Any] = tomllib.loads(args.config.read_text()) if args.config else {}
    for flag in ("url", "algorithm", "rounds", "job_id"):
        if getattr(args, flag) is not None:
            settings[flag] = getattr(args, flag)
    if args.resume:
        settings["resume"] = True
    settings["device"] = default_device(args.device or settings.get("device"))
    job = JobConfig.model_validate(settings)
    try:
        run = run_job(job, environ=os.environ, say=print)
    except RegisteredSizeError as error:
        print(f"dpledger: {error}", file=sys.stderr)
        return 2
    for k, (approved, refused) in enumerate(zip(run.approved_rounds(), run.refused_rounds(), strict=True)):
        metric = run.rounds[-1].metric[k] if run.rounds else float("nan")
        print(f"silo {k}: rounds approved {approved}, refused {refused}, final metric {metric:.4f}")
    if run.stop_reason:
        print(f"stopped: {run.stop_reason}", file=sys.stderr)
    return 0


def _tune(args: argparse.Namespace) -> None:
    from dpledger.tune import TuneConfig, format_outcomes, run_tune

    config = TuneConfig(
        grid=tuple(float(v) for v in args.grid.split(",") if v.strip()), silos=args.silos, rounds=args.rounds,
        mean_trials=args.mean_trials, distribution=args.distribution, shape=args.shape, epsilon=args.epsilon,
        delta=args.delta, noise_multiplier=args.noise_multiplier, seed=args.seed, device=default_device(args.device),
        url=args.url,
    )
    print(format_outcomes(run_tune(config)))
