"""The `dpledger` command. Service commands live here; the worker's (demo, train) are in dpledger.worker_cli
and are imported only when asked for, so the service never loads torch."""

from __future__ import annotations

import argparse
import importlib
import json
import logging.config
import sys
from pathlib import Path

from dpledger.service import people_cli
from dpledger.service.logging_setup import FORMATS, logging_config

WORKER_COMMANDS = ("demo", "train", "tune")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in WORKER_COMMANDS:
        worker = importlib.import_module("dpledger.worker_cli")
        return int(worker.main(argv) or 0)
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpledger", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="command")

    serve = commands.add_parser("serve", help="migrate the database to head, then serve the API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument("--log-format", choices=FORMATS, default="json", help="json: one object a line (default)")
    serve.set_defaults(run=_serve)

    migrate = commands.add_parser("migrate", help="migrate the database to head and stop")
    migrate.set_defaults(run=_migrate)

    keys = commands.add_parser("keys", help="manage API keys directly in the database")
    key_commands = keys.add_subparsers(required=True, metavar="action")
    create = key_commands.add_parser("create", help="create a key and print it once")
    create.add_argument("--role", required=True, choices=["admin", "silo", "auditor", "coordinator"])
    create.add_argument("--silo-id", type=int)
    create.set_defaults(run=_create_key)

    openapi = commands.add_parser("openapi", help="write the OpenAPI document generated from the app")
    openapi.add_argument("--out", type=Path, default=Path("openapi/openapi.json"))
    openapi.set_defaults(run=_openapi)

    people_cli.add_commands(commands)

    for name in WORKER_COMMANDS:
        commands.add_parser(name, help=f"the worker's `{name}` (see `dpledger {name} --help`)")
    return parser


def _serve(args: argparse.Namespace) -> None:
    from dpledger.service.ledger.db import migrate
    from dpledger.service.serving import serve
    from dpledger.service.settings import get_settings

    log_config = logging_config(args.log_format)
    logging.config.dictConfig(log_config)  # the migration's lines too, before uvicorn starts
    migrate(get_settings().database_url)
    # Each worker process re-applies log_config; uvicorn's own access line is replaced by dpledger.access.
    serve(host=args.host, port=args.port, workers=args.workers, log_config=log_config, access_log=False)


def _migrate(_: argparse.Namespace) -> None:
    from dpledger.service.ledger.db import migrate
    from dpledger.service.settings import get_settings

    migrate(get_settings().database_url)


def _create_key(args: argparse.Namespace) -> None:
    from dpledger.service.ledger.db import Database, migrate
    from dpledger.service.ledger.keys import issue
    from dpledger.service.ledger.models import Role
    from dpledger.service.settings import get_settings

    url = get_settings().database_url
    migrate(url)
    db = Database.connect(url)
    try:
        key, raw = issue(db, role=Role(args.role), silo_id=args.silo_id)
    finally:
        db.dispose()
    print(json.dumps({"key_id": key.id, "api_key": raw}))


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
