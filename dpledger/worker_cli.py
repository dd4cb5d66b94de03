"""The worker's commands: `dpledger demo`, `dpledger train` and `dpledger tune`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dpledger.trainer.job_config import ALGORITHMS  # pydantic only: the parser loads no torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dpledger")
    commands = parser.add_subparsers(required=True, metavar="command")

    demo = commands.add_parser("demo", help="run the end-to-end demo on a temporary SQLite ledger")
    demo.add_argument("--silos", type=int, default=10, help="number of digits silos K (default 10)")
    demo.add_argument("--rounds", type=int, default=20, help="rounds R (default 20)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", type=Path, default=Path("dpledger-report"), help="report folder")
    demo.add_argument("--budgets", default="ladder", choices=["ladder", "MixGauss1", "MixGauss2", "MixGauss3"],
                      help="ladder: ε from 3 to 12 (default); MixGauss1-3: drawn from those mixtures")
    demo.add_argument("--noise-multiplier", type=float, default=1.2, help="every silo's DP-SGD σ (default 1.2)")
    demo.add_argument("--calibrate", action="store_true",
                      help="instead: each silo's σ from the service, so that all rounds spend exactly its budget")
    demo.add_argument("--lam", type=float, default=0.01, help="MR-MTL λ (default 0.01)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(run=_demo)

    train = commands.add_parser("train", help="run a configured job against any ledger URL")
    train.add_argument("config", type=Path, nargs="?", help="a TOML file (see README)")
    train.add_argument("--url", help="the ledger's base URL")
    train.add_argument("--algorithm", choices=ALGORITHMS)
    train.add_argument("--algorithms", action="store_true", help="print the table of algorithms and stop")
    train.add_argument("--rounds", type=int)
    train.add_argument("--job-id")
    train.add_argument("--device", default=None)
    train.add_argument("--out", type=Path, default=None, help="folder for models.pt, metrics.jsonl, summary.json "
                       "(default dpledger-job-JOB_ID)")
    train.add_argument("--plan", action="store_true",
                       help="train nothing: print each silo's ε per round and how many rounds its remaining budget buys")
    train.add_argument("--calibrate", action="store_true",
                       help="with --plan: also the σ at which each silo's remaining budget buys all the job's rounds")
    train.add_argument("--resume", action="store_true", default=None,
                       help="continue this job_id's interrupted run from its output folder (the job file's resume = true)")
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(run=_train, argv=argv)

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
    from dpledger.demo import DemoConfig, run_demo

    config = DemoConfig(
        silos=args.silos, rounds=args.rounds, seed=args.seed, out=args.out, budgets=args.budgets, lam=args.lam,
        noise_multiplier=args.noise_multiplier, calibrate=args.calibrate,
        device=default_device(args.device), progress=not args.no_progress,
    )
    table = run_demo(config)
    print(table)
    print(f"\nreport: {config.out}/ (settings.json, metrics.jsonl, accuracy.png, epsilon.png, table.txt)")


EXIT_NOTHING_TRAINED, EXIT_BAD_JOB, EXIT_LEDGER_FAILED = 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
PLAN_HORIZON = 1000  # rounds a plan searches at most


def _say(message: str) -> None:
    print(f"dpledger train: {message}", file=sys.stderr)


def _train(args: argparse.Namespace) -> int:
    """Exit 0: trained; 1: trained nothing (every silo refused at once); 2: the job file or the
    ledger's view of its silos is wrong (nothing charged); 3: the ledger was down or rejected a
    request (whatever ran is written out); 130: SIGINT or SIGTERM (the round in flight settled, the
    output folder written up to the last completed round), one line and no traceback."""
    import signal

    # SIGTERM (a timeout, `kill`) ends a run as Ctrl-C does: the round in flight is settled.
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    _on_signals(signal.SIGINT, signal.default_int_handler)
    _on_signals(signal.SIGTERM, signal.default_int_handler)
    try:
        return _train_job(args)
    except KeyboardInterrupt:  # before the rounds (the loop settles its own and says so itself)
        _say(f"interrupted before round 1 of this run began: it reserved nothing; continue with {_again(args)}")
        return EXIT_INTERRUPTED
    finally:
        _on_signals(signal.SIGINT, previous[0])
        _on_signals(signal.SIGTERM, previous[1])


def _on_signals(number: int, handler: Any) -> None:
    """signal.signal where Python allows it (the main thread); a handler set outside Python (None) stays."""
    import signal
    import threading

    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(number, handler)


def _train_job(args: argparse.Namespace) -> int:
    from dpledger.trainer.job_config import JobFileError, load_job
    from dpledger.trainer.preflight import PreflightError, check_silos

    if args.algorithms:
        from dpledger.trainer.job import algorithms_markdown

        print(algorithms_markdown())
        return 0

    overrides = {name: getattr(args, name) for name in ("url", "algorithm", "rounds", "job_id", "device", "resume")}
    try:
        job = load_job(args.config, overrides=overrides, environ=os.environ)
        silos = check_silos(job, os.environ)
    except JobFileError as error:
        where = f"{args.config}: " if args.config else ""
        for problem in error.problems:
            _say(f"{where}{problem}")
        return EXIT_BAD_JOB
    except PreflightError as error:
        for problem in error.problems:
            _say(problem)
        return EXIT_LEDGER_FAILED if error.unreachable else EXIT_BAD_JOB
    names = ", ".join(s.label for s in silos)
    _say(f"job {job.job_id!r}: {job.algorithm}, {job.rounds} rounds, {names}; keys and ledger checked")
    return _train_checked(job, silos, args)


def _train_checked(job: Any, silos: list[Any], args: argparse.Namespace) -> int:
    import signal

    from tqdm import tqdm

    from dpledger.trainer import pause, resume
    from dpledger.trainer.data.npz import SiloFileError
    from dpledger.trainer.job import build, load_data, run_job, write_outputs
    from dpledger.trainer.loop import Interrupted
    from dpledger.trainer.preflight import check_sizes
    from dpledger.wire.errors import LedgerError

    try:
        dataset = load_data(job.data)
    except SiloFileError as error:
        _say(f"data.path: {error}")
        return EXIT_BAD_JOB
    mismatched = check_sizes(silos, [s.n_train for s in dataset.silos])
    if mismatched:
        for problem in mismatched:
            _say(problem)
        return EXIT_BAD_JOB
    algorithm = build(job, dataset, device=default_device(job.device))
    if args.plan:
        return _plan(job, silos, algorithm, calibrate=args.calibrate)

    out = args.out or Path(f"dpledger-job-{job.job_id}")
    fresh, start = algorithm, None
    if job.resume:
        try:
            prepared = resume.prepare(job, silos, fresh, out, os.environ)
        except resume.ResumeError as error:
            for problem in error.problems:
                _say(problem)
            return EXIT_BAD_JOB
        except LedgerError as error:
            _say(f"the ledger could not settle the job's open charges: {error}")
            return EXIT_LEDGER_FAILED
        algorithm, start = prepared.algorithm, prepared.start
        where = "from round 1" if prepared.completed < 0 else (
            f"after round {prepared.completed + 1} ({out / resume.CHECKPOINT})")
        _say(f"resuming job {job.job_id!r} {where}")
        for line in prepared.lines:
            _say(line)
    journal = resume.Journal(out, job, algorithm, completed=-1 if start is None else start.first_round - 1,
                             run=None if start is None else start.run)

    bar = tqdm(total=job.rounds, desc=job.job_id, unit="round", file=sys.stderr, disable=args.no_progress,
               initial=0 if start is None else start.first_round)

    def progress(record: Any) -> None:
        approved = sum(record.approved)
        bar.set_postfix_str(f"approved {approved}/{len(silos)}, max ε spent {max(record.epsilon_spent):.3g}")
        bar.update()

    try:
        run = run_job(job, algorithm, silos, environ=os.environ, on_round=progress, start=start, journal=journal,
                      pause=pause.from_env(os.environ))
    except Interrupted as stop:
        bar.close()
        return _interrupted(stop.run, journal, fresh, job, silos, out, args)
    finally:
        bar.close()
    # Every round is settled: a late Ctrl-C waits until the folder and the table are written.
    _on_signals(signal.SIGINT, signal.SIG_IGN)
    _on_signals(signal.SIGTERM, signal.SIG_IGN)
    try:
        after = _ledger_after(job, silos)
        write_outputs(out, job, algorithm, run, silos, after)
    finally:
        _on_signals(signal.SIGINT, signal.default_int_handler)
        _on_signals(signal.SIGTERM, signal.default_int_handler)
    print(_summary_table(run, silos, after))
    for k, refusal in sorted(run.refusals.items()):
        would = "∞" if refusal.epsilon_if_approved is None else f"{refusal.epsilon_if_approved:.4g}"
        spent = "∞" if refusal.epsilon_spent is None else f"{refusal.epsilon_spent:.4g}"
        reference = "" if refusal.epsilon_dp_accounting is None else (
            f" (the gate's reading; dp-accounting's non-adaptive ε of the same charges, for reference: "
            f"{refusal.epsilon_dp_accounting:.4g})")
        _say(f"{silos[k].label}: refused at round {refusal.round_index + 1}: it would have reached ε = {would}{reference} "
             f"> budget {refusal.budget:.4g} (ε spent {spent})")
    _say(f"wrote {out}/ (models.pt, metrics.jsonl, summary.json)")
    if run.failed:
        _say(f"stopped: {run.stop_reason}")
        return EXIT_LEDGER_FAILED
    if not any(run.approved_rounds()):
        _say("nothing trained: the ledger refused every silo's first round (see `dpledger train --plan`)")
        return EXIT_NOTHING_TRAINED
    return 0


def _interrupted(run: Any, journal: Any, fresh: Any, job: Any, silos: list[Any], out: Path,
                 args: argparse.Namespace) -> int:
    """The output folder as of the last completed round, and one line: how the round in flight was
    settled and the command that continues the job."""
    import signal

    from dpledger.trainer.job import write_outputs

    stop = run.interrupted
    _on_signals(signal.SIGINT, signal.SIG_IGN)  # the folder and the line are written whatever comes next
    _on_signals(signal.SIGTERM, signal.SIG_IGN)
    try:
        kept = journal.restore(fresh)
        kept.run.stop_reason = f"interrupted in round {stop.round_index + 1}"
        kept.run.interrupted = stop
        write_outputs(out, job, kept.algorithm, kept.run, silos, _ledger_after(job, silos))
    finally:
        _on_signals(signal.SIGINT, signal.default_int_handler)
    again = _again(args)
    settled = []
    if stop.committed:
        settled.append(f"{_charges(stop.committed)} committed (the round had read data)")
    if stop.released:
        settled.append(f"{_charges(stop.released)} released (the round had not read data)")
    if stop.reserved:
        settled.append(f"{_charges(stop.reserved)} left reserved, so spent (the ledger did not answer in time)")
    done = kept.completed + 1
    what = (f"in round {stop.round_index + 1}: " + ", ".join(settled)) if settled else (
        f"after round {done}: every charge of it settled" if done else "before round 1: nothing was reserved")
    _say(f"interrupted {what}; continue with {again}")
    return EXIT_INTERRUPTED


def _again(args: argparse.Namespace) -> str:
    """The command that continues this job: the same one, with --resume unless the job file says resume = true."""
    import shlex

    argv = [a for a in args.argv if a != "--resume"]
    return shlex.join(["dpledger", *argv, *([] if "resume" in _job_file_keys(args.config) else ["--resume"])])


def _charges(ids: list[int]) -> str:
    return ("charge " if len(ids) == 1 else "charges ") + ", ".join(str(i) for i in ids)


def _job_file_keys(path: Path | None) -> set[str]:
    """The top-level keys the job file sets (a file with resume = true needs no --resume)."""
    import tomllib

    if path is None:
        return set()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return set()
    return {key for key, value in data.items() if key != "resume" or value is True}


def _ledger_after(job: Any, silos: list[Any]) -> list[Any]:
    """Each silo as the ledger shows it now, for the summary; None where the ledger is silent."""
    from dpledger.trainer.job_config import silo_key
    from dpledger.trainer.preflight import PREFLIGHT_RETRY, LedgerSilo, ledger_silo
    from dpledger.wire.client import LedgerClient
    from dpledger.wire.errors import LedgerError

    after: list[LedgerSilo | None] = []
    for silo, entry in zip(silos, job.silos, strict=True):
        with LedgerClient(job.url, silo_key(entry, os.environ), retry=PREFLIGHT_RETRY, timeout=10.0) as client:
            try:
                after.append(ledger_silo(client.silo(silo.id)))
            except LedgerError:
                after.append(None)
    return after


def _summary_table(run: Any, silos: list[Any], after: list[Any]) -> str:
    from dpledger.trainer.preflight import EPSILON_LEGEND, Reading

    header = ("silo", "name", "ε budget", "ε spent", "approved", "refused", "final metric")
    rows = []
    for k, silo in enumerate(silos):
        now = after[k]
        spent = "?" if now is None else str(Reading(now.epsilon_spent, now.epsilon_dp_accounting))
        metric = f"{run.rounds[-1].metric[k]:.4f}" if run.rounds else "—"
        rows.append((str(silo.id), silo.name, f"{silo.epsilon:.4g}", spent, str(run.approved_rounds()[k]),
                     str(run.refused_rounds()[k]), metric))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
    return "\n".join([*lines, EPSILON_LEGEND])


def _plan(job: Any, silos: list[Any], algorithm: Any, *, calibrate: bool) -> int:
    from dpledger.trainer.job_config import silo_key
    from dpledger.trainer.preflight import format_plan, plan_silo, sigma_up
    from dpledger.wire.client import LedgerClient
    from dpledger.wire.errors import LedgerError

    horizon = max(job.rounds, PLAN_HORIZON)
    declared = [algorithm.round_mechanisms(r) for r in range(horizon)]
    plans = []
    for k, (silo, entry) in enumerate(zip(silos, job.silos, strict=True)):
        # One request per silo: each silo's key reads only its own budget.
        with LedgerClient(job.url, silo_key(entry, os.environ)) as client:
            try:
                plans.append(plan_silo(client, silo, [declared[r][k] for r in range(horizon)], rounds=job.rounds,
                                       calibrate=calibrate))
            except LedgerError as error:
                _say(f"{silo.label}: the ledger could not quote its rounds: {error}")
                return EXIT_LEDGER_FAILED
    sigmas = [p.noise_multiplier for p in plans]
    print(f"plan of job {job.job_id!r}: {job.algorithm}, {job.rounds} rounds, noise_multiplier "
          f"{job.dpsgd.noise_multiplier}, batch_size {job.dpsgd.batch_size}, local_steps {job.dpsgd.local_steps}; "
          "ε from the ledger's own quotes at each silo's δ, after what it has spent")
    print(format_plan(plans, rounds=job.rounds, sigmas=sigmas if calibrate else None))
    for plan in plans:
        if plan.affordable_rounds < job.rounds:
            print(f"{plan.silo.label}: its budget stops it after {plan.affordable_rounds} of {job.rounds} rounds; "
                  "raise dpsgd.noise_multiplier or lower rounds to train them all")
    if calibrate:
        known = [s for s in sigmas if s is not None]
        if len(known) == len(sigmas):
            print(f"every silo trains all {job.rounds} rounds at dpsgd.noise_multiplier = {sigma_up(max(known))} "
                  "(the largest σ above: one σ serves every silo of a job)")
        else:
            print("σ is calibrated only where every round is plain DP-SGD of one shape (— elsewhere)")
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
