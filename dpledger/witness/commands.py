"""`dpledger witness`, `dpledger witness keys create`, `dpledger witness log-key`: the witness's
commands (`cosigner` holds what it does)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import httpx

from dpledger.people import terminal
from dpledger.wire import note
from dpledger.wire.note import NoteError, VerifierKey
from dpledger.wire.receipts import PublicKey
from dpledger.witness.cosigner import FetchError, LedgerLog, Witness, run, serve


def _log_key(text: str) -> VerifierKey:
    try:
        key = VerifierKey.parse(text)
    except NoteError as error:
        raise terminal.CliError(f"--log-key: {error}") from None
    if key.signature_type != note.ED25519:
        raise terminal.CliError("--log-key: the log signs with an Ed25519 note key (type 0x01), not a cosigner key")
    return key


def _signer(path: Path) -> note.Signer:
    try:
        return note.Signer.parse(path.read_text())
    except OSError as error:
        raise terminal.CliError(f"--key: cannot read {path}: {error.strerror}") from None
    except NoteError as error:
        raise terminal.CliError(f"--key: {path} is not a witness key (`dpledger witness keys create`): {error}") from None


@terminal.reports_errors
def witness_command(args: argparse.Namespace) -> int:
    if args.log_key is None or args.key is None:
        raise terminal.CliError("the witness needs --log-key (the log's verifier key, pinned) and --key (its own key file)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    ledger = LedgerLog(args.ledger or terminal.ledger_url(), terminal.ledger_key())
    try:
        witness = Witness(ledger=ledger, log_key=_log_key(args.log_key), signer=_signer(args.key),
                          state_path=args.state, out=args.out)
    except NoteError as error:
        raise terminal.CliError(f"{args.state} does not hold this witness's cosignature of this log: {error}") from None
    if args.once:
        try:
            cosigned, said = witness.poll()
        except (FetchError, httpx.HTTPError) as error:
            raise terminal.CliError(f"could not read the ledger: {error}") from None
        print(said if cosigned else f"REFUSED: {said}")
        return 0 if cosigned else terminal.EXIT_BROKEN
    server = serve(witness, args.port)
    print(f"witness {witness.signer.name} serving http://127.0.0.1:{server.server_address[1]}/checkpoint, "
          f"polling {ledger.url} every {args.interval:g} s", flush=True)
    try:
        run(witness, interval=args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


@terminal.reports_errors
def keys_create(args: argparse.Namespace) -> int:
    if not note.valid_name(args.name):
        raise terminal.CliError(f"--name: a key name has no space and no '+'; found {args.name!r}")
    if args.out.exists():
        raise terminal.CliError(f"{args.out} exists: a witness keeps its key (a new key is a new witness)")
    signer = note.Signer.generate(args.name, note.COSIGNATURE_V1)
    descriptor = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a secret: its owner alone reads it
    with os.fdopen(descriptor, "w") as file:
        file.write(signer.encode() + "\n")
    print(signer.verifier.encode())
    return 0


@terminal.reports_errors
def log_key(args: argparse.Namespace) -> int:
    """The ledger's checkpoint verifier key, from its public key and its checkpoint's origin: compare it
    with what the operator published before pinning it."""
    ledger = LedgerLog(terminal.ledger_url(), terminal.ledger_key())
    try:
        public = PublicKey(**ledger.json("/v1/log/public-key"))
        origin = ledger.checkpoint().split("\n", 1)[0]
    except (FetchError, httpx.HTTPError) as error:
        raise terminal.CliError(f"could not read the ledger: {error}") from None
    key = VerifierKey(origin, note.ED25519, bytes.fromhex(public.public_key))
    note.open_checkpoint(ledger.checkpoint(), key)  # the served checkpoint is signed by the key printed
    print(key.encode())
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    witness = commands.add_parser(
        "witness", help="cosign the ledger's checkpoints that extend the last one cosigned (C2SP tlog-cosignature)",
        description="Reads DPLEDGER_URL and DPLEDGER_KEY (a key that may read the log: auditor, admin or silo).",
    )
    witness.add_argument("--ledger", metavar="URL", help="the ledger (default $DPLEDGER_URL)")
    witness.add_argument("--log-key", metavar="VKEY", help="the log's verifier key <origin>+<id>+<key>, pinned out of band")
    witness.add_argument("--key", type=Path, metavar="FILE", help="this witness's key file (`dpledger witness keys create`)")
    witness.add_argument("--state", type=Path, default=Path("witness-state.json"), metavar="FILE",
                         help="the checkpoint last cosigned and the refusals (default ./witness-state.json)")
    witness.add_argument("--out", type=Path, metavar="FILE", help="also write each cosigned checkpoint here")
    witness.add_argument("--port", type=int, default=7380, help="serve GET /checkpoint on 127.0.0.1:PORT (default 7380)")
    witness.add_argument("--interval", type=float, default=10.0, metavar="SECONDS", help="between polls (default 10)")
    witness.add_argument("--once", action="store_true", help="poll once, print the outcome, exit (1 if refused)")
    witness.set_defaults(run=witness_command)
    actions = witness.add_subparsers(metavar="action", dest="witness_action")
    keys = actions.add_parser("keys", help="the witness's own key")
    create = keys.add_subparsers(required=True, metavar="action").add_parser(
        "create", help="write a new cosigner key to FILE and print its verifier key (give that to silos)")
    create.add_argument("--name", required=True, help="the witness's key name, e.g. witness.example.org/w1")
    create.add_argument("--out", type=Path, required=True, metavar="FILE")
    create.set_defaults(run=keys_create)
    printed = actions.add_parser("log-key", help="print the ledger's checkpoint verifier key (to compare and pin)")
    printed.set_defaults(run=log_key)
