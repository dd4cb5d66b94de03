"""The `dpledger` command. Service commands live here; the worker's (demo, train) are in dpledger.worker_cli
and are imported only when asked for, so the service never loads torch."""
# (The docstring above is for whoever reads this file; a person running `dpledger --help` reads DESCRIPTION.)

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging.config
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dpledger.audit import commands as audit_commands
from dpledger.people import commands as people_commands
from dpledger.service.logging_setup import FORMATS, logging_config
from dpledger.witness import commands as witness_commands

if TYPE_CHECKING:
    from dpledger.service.settings import Settings

WORKER_COMMANDS = ("demo", "train", "tune")
FLWR_RUN = "flwr-run"  # dpledger/flower/flwr_run.py: its arguments are flwr run's, passed through

DESCRIPTION = (
    "dpledger: a privacy ledger for cross-silo federated learning. Each silo promises its own (ε, δ); the ledger "
    "approves a training round only while the silo's spent ε stays within it, and lets auditors check what was spent. "
    "Start with `dpledger demo`; run your own ledger with `dpledger init` and `dpledger serve`."
)
EPILOG = (
    "Commands that talk to a running ledger read DPLEDGER_URL (default http://127.0.0.1:8000) and DPLEDGER_KEY (an API "
    "key); the server's own commands (serve, migrate, init, keys) read DATABASE_URL (default sqlite:///./dpledger.db). "
    "`dpledger COMMAND --help` says more."
)
# What `--help` says of commands whose arguments another module defines (dpledger/audit/commands.py).
DESCRIPTIONS = {
    "audit": "Checks the ledger as an auditor: the transparency log's signed head, that the log only grew since the "
    "head saved in HEAD_FILE (a consistency proof; on first use the ledger's signing key is pinned there), every "
    "leaf against the record it covers, and every silo's ε recomputed from its charges. Exit 0: all hold, and "
    "HEAD_FILE now holds the new head; exit 1: something failed, each problem on a line (a proof of misbehaviour "
    "printed in full). Reads DPLEDGER_URL and DPLEDGER_KEY (an auditor's or admin's key).",
    "pubkey": "Prints the Ed25519 public key that signs the ledger's transparency-log heads, and its key id (--json: "
    "as the API sends them). Keep it where the ledger cannot edit it, and check receipts against it with "
    "`dpledger verify --receipts DIR --public-key HEX`. Reads DPLEDGER_URL and DPLEDGER_KEY (any key the ledger knows).",
}


EXIT_CLOSED_PIPE = 128 + 13  # what a shell reports for a process that SIGPIPE ended, as `yes | head` does


def main(argv: list[str] | None = None) -> int:
    """Every command, worker's included, runs here: a reader that stops early (`dpledger history 1 | head`)
    ends the command quietly in this one place, never with a traceback."""
    try:
        code = _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at the interpreter's exit: output still buffered meets the closed pipe now
        return code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_CLOSED_PIPE


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in WORKER_COMMANDS:
        worker = importlib.import_module("dpledger.worker_cli")
        return int(worker.main(argv) or 0)
    if argv[:1] == [FLWR_RUN] and not {"-h", "--help"} & set(argv[1:]):
        flwr_run = importlib.import_module("dpledger.flower.flwr_run")  # the `flower` extra's, only when asked for
        return int(flwr_run.main(argv[1:]))
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's final flush of what is still buffered
    does not fail again on the closed pipe (the recipe of Python's `signal` documentation)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout replaced by something without a descriptor (a test's capture)
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpledger", description=DESCRIPTION, epilog=EPILOG)
    commands = parser.add_subparsers(required=True, metavar="command", dest="command")

    serve = commands.add_parser("serve", help="migrate the database to head, then serve the API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument("--log-format", choices=FORMATS, default="json", help="json: one object a line (default)")
    serve.set_defaults(run=_serve)

    migrate = commands.add_parser("migrate", help="migrate the database to head and stop")
    migrate.set_defaults(run=_migrate)

    init = commands.add_parser(
        "init", help="first start: migrate the database and print its first admin key (stdout), once",
        description="Refuses when the database already has an admin key: create more with `keys create --role admin`.",
    )
    init.set_defaults(run=_init)

    keys = commands.add_parser(
        "keys", help="create an API key directly in the database (no server needed): an admin, silo, auditor or "
        "coordinator key",
        description="Writes to the database DATABASE_URL names (migrating it first), not over HTTP: for the operator "
        "who holds the database, e.g. a second admin key, or an auditor's. A running server creates keys too: "
        "POST /v1/keys with an admin key.",
    )
    key_commands = keys.add_subparsers(required=True, metavar="action")
    create = key_commands.add_parser(
        "create", help="create a key and print it once, as JSON (key_id, api_key); only its SHA-256 is stored",
        description="Prints {\"key_id\": N, \"api_key\": \"…\"} once; the database keeps only the key's SHA-256.",
    )
    create.add_argument("--role", required=True, choices=["admin", "silo", "auditor", "coordinator"],
                        help="admin: everything; silo: its own silo's budget and charges; auditor: reads and "
                        "verifies every silo, changes nothing; coordinator: a job's norms and groups, no budgets")
    create.add_argument("--silo-id", type=int, help="with --role silo: the silo the key spends for")
    create.set_defaults(run=_create_key)

    openapi = commands.add_parser("openapi", help="write the OpenAPI document generated from the app")
    openapi.add_argument("--out", type=Path, default=Path("openapi/openapi.json"))
    openapi.set_defaults(run=_openapi)

    data = commands.add_parser("data", help="write example silo data files")
    data_sources = data.add_subparsers(required=True, metavar="source")
    digits = data_sources.add_parser(
        "digits", help="scikit-learn's 8×8 digits, disjoint slices: silo-1.npz … silo-K.npz (x, y, x_test, y_test)",
        description="Each file holds `x` (n, 64) in [0, 1], `y`, `x_test`, `y_test`: a silo's Flower data file "
        "(data-path). Register each silo with --dataset-size at most --train.",
    )
    digits.add_argument("--silos", type=int, required=True)
    digits.add_argument("--train", type=int, default=400, help="training records per silo (default 400)")
    digits.add_argument("--test", type=int, default=100, help="test records per silo (default 100)")
    digits.add_argument("--seed", type=int, default=0)
    digits.add_argument("--out", type=Path, default=Path("."), help="the folder (default: here)")
    digits.add_argument("--force", action="store_true", help="replace existing files")
    digits.set_defaults(run=_data_digits)

    wait = commands.add_parser(
        "wait", help="wait until a server answers; exit 1 with one line if none does in time",
        description="TARGET is a URL (waits for a 2xx answer, e.g. http://127.0.0.1:8000/healthz) or HOST:PORT "
        "(waits until it accepts a TCP connection).",
    )
    wait.add_argument("target", metavar="TARGET")
    wait.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    wait.set_defaults(run=_wait)

    # The commands run from outside the ledger, over HTTP: the people's, the auditors', the witness's.
    people_commands.add_commands(commands)
    audit_commands.add_commands(commands)
    witness_commands.add_commands(commands)
    for name, description in DESCRIPTIONS.items():
        commands.choices[name].description = description

    for name in WORKER_COMMANDS:
        commands.add_parser(name, help=f"the worker's `{name}` (see `dpledger {name} --help`)")
    commands.add_parser(
        FLWR_RUN, help="`flwr run … --stream` whose exit code is the run's outcome (0 completed, 1 not)",
        description="Takes `flwr run`'s arguments (APP [SUPERLINK] [options]) and runs it with --stream; then asks the "
        "SuperLink for the run's status and exits 0 (finished:completed), 1 (any other end: the ServerApp raised or was "
        "killed), or flwr run's own code when that failed; 130 when it is stopped itself. Needs the `flower` extra.",
    )
    return parser


class StartupError(Exception):
    """A settings or database problem found before serving: one line, exit 2, no traceback."""


def _one_line(command: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int]:
    """Settings and database errors of the service's own commands as one line on stderr, exit 2."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from pydantic import ValidationError
        from sqlalchemy.exc import ArgumentError, SQLAlchemyError

        from dpledger.service.api.ledger_file import LedgerInUse
        from dpledger.service.ledger.errors import LedgerError
        from dpledger.service.store.db import UnknownRevision

        try:
            return int(command(args) or 0)
        except BrokenPipeError:  # a reader that stopped early is not a failure of the command: main() ends it
            raise
        except ValidationError as error:  # Settings: the variable's name and what is wrong with it
            problems = "; ".join(f"{_variable(e['loc'])}{e['msg'].removeprefix('Value error, ')}" for e in error.errors())
            message = f"settings: {problems}"
        except ArgumentError as error:
            message = f"DATABASE_URL is not a database URL SQLAlchemy understands: {error}"
        except SQLAlchemyError as error:
            message = f"the database (DATABASE_URL) refused: {str(error).splitlines()[0]}"
        except (StartupError, LedgerError, UnknownRevision, LedgerInUse, OSError) as error:
            message = str(error)
        print(f"dpledger {args.command}: {message}", file=sys.stderr)
        return 2

    return run


def _variable(location: tuple[int | str, ...]) -> str:
    named = [str(part) for part in location if str(part) != "__root__"]
    return f"DPLEDGER_{named[0].upper()}: " if named else ""


def _settings() -> Settings:
    """The service's settings, imported late so that `dpledger --help` stays light."""
    from dpledger.service.settings import get_settings

    settings = get_settings()
    hint = database_url_hint(settings.database_url)
    if hint is not None:
        raise StartupError(hint)
    return settings


def database_url_hint(url: str) -> str | None:
    """The PostgreSQL URLs other tools write (Heroku's `postgres://`, libpq's `postgresql://`) name a
    driver dpledger does not install: SQLAlchemy answered "Can't load plugin" or a psycopg2 traceback."""
    scheme, separator, rest = url.partition("://")
    if not separator or scheme not in ("postgres", "postgresql"):
        return None
    _, at, where = rest.rpartition("@")  # the password is not repeated on the terminal
    corrected = f"postgresql+psycopg://{'…@' if at else ''}{where}"
    return (f"DATABASE_URL starts {scheme}://, which names a driver dpledger does not install: write it as "
            f"{corrected} (psycopg 3, the `postgres` extra: pip install 'dpledger[postgres]')")


@_one_line
def _serve(args: argparse.Namespace) -> None:
    from dpledger.service.api.ledger_file import hold_ledger
    from dpledger.service.serving import serve
    from dpledger.service.store.db import migrate

    settings = _settings()  # first: a settings error is said before anything is logged
    hold_ledger(settings.database_url)  # before the port: a second server on this ledger is the mistake to name
    _check_port_free(args.host, args.port)
    log_config = logging_config(args.log_format)
    logging.config.dictConfig(log_config)  # the migration's lines too, before uvicorn starts
    migrate(settings.database_url)
    # Each worker process re-applies log_config; uvicorn's own access line is replaced by dpledger.access.
    serve(host=args.host, port=args.port, workers=args.workers, log_config=log_config, access_log=False)


def _check_port_free(host: str, port: int) -> None:
    """uvicorn reports a taken port as a logged traceback; this says it in one line first."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as error:
            raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from None


@_one_line
def _migrate(_: argparse.Namespace) -> None:
    from dpledger.service.store.db import migrate

    migrate(_settings().database_url)


@_one_line
def _init(args: argparse.Namespace) -> None:
    from dpledger.service.ledger.keys import create_key
    from dpledger.service.store import records
    from dpledger.service.store.db import Database, migrate
    from dpledger.service.store.models import Role

    url = _settings().database_url
    migrate(url)
    db = Database.connect(url)
    engine = db.engine
    try:
        with db.write() as session:
            if records.live_admin_key_id(session) is not None:
                raise StartupError(
                    f"{engine.url.render_as_string(hide_password=True)} has an admin key already; "
                    "`dpledger keys create --role admin` makes another"
                )
            _, raw = create_key(session, role=Role.admin, silo_id=None)
    finally:
        db.dispose()
    print(raw)  # alone on stdout, so that `export DPLEDGER_KEY=$(dpledger init)` works
    print("dpledger init: database migrated; the admin key above is shown once (stored as its SHA-256)", file=sys.stderr)


@_one_line
def _create_key(args: argparse.Namespace) -> None:
    from dpledger.service.ledger.keys import issue
    from dpledger.service.store.db import Database, migrate
    from dpledger.service.store.models import Role

    url = _settings().database_url
    migrate(url)
    db = Database.connect(url)
    try:
        key, raw = issue(db, role=Role(args.role), silo_id=args.silo_id)
    finally:
        db.dispose()
    print(json.dumps({"key_id": key.id, "api_key": raw}))


def _data_digits(args: argparse.Namespace) -> int:
    from dpledger.trainer.data.digits_files import write_digits_silo_files

    try:
        paths = write_digits_silo_files(args.out, silos=args.silos, train=args.train, test=args.test, seed=args.seed,
                                        overwrite=args.force)
    except (ValueError, OSError) as error:
        print(f"dpledger data digits: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    print(f"dpledger data digits: {len(paths)} silos, {args.train} training and {args.test} test records each",
          file=sys.stderr)
    return 0


def _wait(args: argparse.Namespace) -> int:
    """Polls TARGET until it answers, so that a script's next command finds its server up."""
    import socket
    import time

    import httpx

    is_url = "://" in args.target
    if is_url:
        try:
            url: httpx.URL | None = httpx.URL(args.target)
        except httpx.InvalidURL:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            print(f"dpledger wait: {args.target!r} is not an http(s) URL", file=sys.stderr)
            return 2
    else:
        host, _, port = args.target.rpartition(":")
        if not host or not port.isdigit():
            print(f"dpledger wait: {args.target!r} is neither a URL nor HOST:PORT", file=sys.stderr)
            return 2
    deadline = time.monotonic() + args.timeout
    last = "nothing tried"
    while True:
        try:
            if is_url:
                status = httpx.get(args.target, timeout=2.0, follow_redirects=True).status_code
                if 200 <= status < 300:
                    return 0
                last = f"HTTP {status}"
            else:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                    return 0
        except (httpx.HTTPError, OSError) as error:
            last = str(error) or type(error).__name__
        if time.monotonic() >= deadline:
            print(f"dpledger wait: {args.target} did not answer within {args.timeout:g} s (last: {last})", file=sys.stderr)
            return 1
        time.sleep(0.2)


def openapi_document() -> str:
    from dpledger.service.api.app import create_app
    from dpledger.service.settings import Settings

    # The document depends only on the routes; an in-memory database keeps generation side-effect free.
    app = create_app(Settings(database_url="sqlite://", admin_key=None))
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def _openapi(args: argparse.Namespace) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(openapi_document())


if __name__ == "__main__":
    sys.exit(main())
