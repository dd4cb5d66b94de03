"""`dpledger verify`, `dpledger audit --since HEAD_FILE`, `dpledger pubkey`: the auditors' commands (and
a silo's, checking the receipts it holds). What they check is in `transparency` and `recompose`;
which held receipts a check reads, in `held`; the witnesses' part of `verify`, in `witnessed`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpledger.audit import held, witnessed
from dpledger.audit.transparency import ask, audit, guarded, http_get, report
from dpledger.people import terminal
from dpledger.wire.client import LedgerClient
from dpledger.wire.receipts import SignedTreeHead


@terminal.reports_errors
def verify_command(args: argparse.Namespace) -> int:
    """The chain as the ledger recomputes it (`GET /v1/audit/verify`), or with --receipts the receipts a
    silo holds against the log, and with --witness against what witnesses cosigned."""
    if getattr(args, "receipts", None) is not None:
        code = verify_receipts_command(args)
        if args.witness or args.require_witnesses:  # `--witness`: what independent witnesses cosigned
            code = witnessed.combined(code, witnessed.verify_witnesses_command(args))
        return code
    if getattr(args, "witness", None) or getattr(args, "require_witnesses", 0):
        raise terminal.CliError("--witness and --require-witnesses check held receipts: add --receipts")
    with terminal.ledger() as client:
        report = client.verify_chain()
    if report.ok:
        print(f"ok: {report.entries} entries, every hash recomputes")
        return 0
    print(
        f"BROKEN: {report.entries} entries; first bad entry seq {report.first_bad_seq} "
        f"of silo {report.first_bad_silo_id}; edited charges {report.bad_charge_ids}"
    )
    for problem in report.problems:
        print(f"  - {problem}")
    return terminal.EXIT_BROKEN


@terminal.reports_errors
def verify_receipts_command(args: argparse.Namespace) -> int:
    folder = held.require(held.receipts_folder(args.receipts))
    return report(held.check(guarded(http_get), folder, public_key=args.public_key, silo=args.silo,
                             holder=terminal.ledger_key()))


@terminal.reports_errors
def audit_command(args: argparse.Namespace) -> int:
    try:
        since = json.loads(args.since.read_text()) if args.since.exists() else None
        if since is not None:
            SignedTreeHead.model_validate(since["head"])
            bytes.fromhex(since["public_key"])
    except (ValueError, KeyError, TypeError) as error:  # json's and pydantic's errors are ValueErrors
        raise terminal.CliError(f"{args.since} is not a head file that `dpledger audit` wrote: {error}") from None
    out = audit(guarded(http_get), since)
    code = report(out)
    if out.ok and out.head is not None:
        key = since["public_key"] if since is not None else ask(LedgerClient.log_public_key).public_key
        args.since.write_text(json.dumps({"public_key": key, "head": out.head.model_dump(),
                                          "budgets": {str(k): v for k, v in sorted(out.budgets.items())}}, indent=2) + "\n")
        print(f"saved the head of size {out.head.tree_size} to {args.since}")
        try:
            head = out.head
            ask(lambda client: client.record_verified(head))
        except terminal.CliError as error:  # the record on the dashboard is a courtesy, the file is the proof
            print(f"note: the ledger did not record this verification: {error}")
    return code


@terminal.reports_errors
def pubkey_command(args: argparse.Namespace) -> int:
    key = ask(LedgerClient.log_public_key)
    print(json.dumps(key.model_dump(), indent=2) if args.json else f"{key.algorithm} {key.public_key}  key id {key.key_id}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Wires `verify`, `audit` and `pubkey` into `dpledger`'s parser (dpledger/cli.py)."""
    verify = commands.add_parser("verify", help="recompute the audit chain, or check held receipts; exit 1 if broken (over HTTP)",
                                 description=f"Reads DPLEDGER_URL (default {terminal.DEFAULT_URL}) and DPLEDGER_KEY "
                                 "(a reader's API key).")
    verify.set_defaults(run=verify_command)
    verify.add_argument("--receipts", type=Path, metavar="DIR", nargs="?", const=held.DEFAULT_RECEIPTS,
                        help="check the receipts in DIR (*.jsonl, as the trainer's client keeps them) against the log; "
                        "DIR defaults to where the client keeps them ($DPLEDGER_RECEIPTS, else ~/.local/share/dpledger/receipts)")
    verify.add_argument("--silo", type=int, metavar="ID", help="with --receipts: only this silo's receipts")
    verify.add_argument("--public-key", metavar="HEX", help="with --receipts: the ledger's key, pinned out of band")
    auditing = commands.add_parser(
        "audit", help="check the log against the last head you saw, and every silo's ε against its charges",
        description="Reads DPLEDGER_URL and DPLEDGER_KEY (an auditor's or admin's key).",
    )
    auditing.add_argument("--since", type=Path, required=True, metavar="HEAD_FILE",
                          help="the head this party last verified (created on first use; replaced when all checks hold)")
    auditing.set_defaults(run=audit_command)
    pubkey = commands.add_parser("pubkey", help="print the Ed25519 key that signs the log's tree heads")
    pubkey.add_argument("--json", action="store_true")
    pubkey.set_defaults(run=pubkey_command)
    witnessed.add_arguments(verify)
