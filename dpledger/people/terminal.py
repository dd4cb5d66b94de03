"""What every command run against a ledger from outside shares: the ledger and key from the environment,
the one typed client over them, and every failure said on one line with the exit codes scripts read
(1: a check found something broken; 2: could not ask). The people's, the auditors' and the witness's
commands all import it; it imports none of them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from dpledger.wire.client import LedgerClient, Retry
from dpledger.wire.errors import LedgerError, Rejected, Unreachable
from dpledger.wire.safe_text import visible

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_BROKEN, EXIT_FAILED = 1, 2


class CliError(Exception):
    """Said to the person on one line; never a traceback."""


def ledger_url() -> str:
    return os.environ.get("DPLEDGER_URL", DEFAULT_URL).rstrip("/")


def ledger_key() -> str:
    key = os.environ.get("DPLEDGER_KEY")
    if not key:
        raise CliError("DPLEDGER_KEY is not set: export an admin, auditor or silo API key")
    return key


def ledger(*, timeout: float = 30.0) -> LedgerClient:
    """The typed client over $DPLEDGER_URL with $DPLEDGER_KEY. One attempt per request (a person at
    a terminal asks again; a worker's retries would only delay the answer), and no receipts kept:
    the receipts of a silo's charges are its worker's."""
    return LedgerClient(ledger_url(), ledger_key(), retry=Retry(window=0), timeout=timeout, receipts=False)


def detail(body: Any) -> str:
    """The reason an error answer gives: FastAPI's `detail`, its validation errors as field: reason."""
    if not isinstance(body, dict):
        return (body if isinstance(body, str) else json.dumps(body)).strip()[:200]
    found = body.get("detail")
    if isinstance(found, list) and all(isinstance(d, dict) and "loc" in d for d in found):
        # FastAPI's validation errors: the field and the reason, not the JSON
        return "; ".join(f"{'.'.join(str(p) for p in d['loc'] if p != 'body')}: {d.get('msg', '')}" for d in found)
    return found if isinstance(found, str) else json.dumps(found)


def said(error: LedgerError) -> str:
    """The one line a person reads for an error of the client's tree."""
    if isinstance(error, Unreachable):
        if error.status_code is None:
            return f"cannot reach the ledger at {ledger_url()} (DPLEDGER_URL): {error.last}"
        return f"HTTP {error.status_code} from {error.path}: {detail(error.body)}"
    if isinstance(error, Rejected):
        if error.status_code == 401:
            return f"401 unauthorized: DPLEDGER_KEY was refused ({detail(error.body)})"
        if error.status_code == 403:
            verb = "read" if error.method == "GET" else "write"
            return f"403 forbidden: this key may not {verb} {error.path} ({detail(error.body)})"
        return f"HTTP {error.status_code} from {error.path}: {detail(error.body)}"
    return str(error)


def reports_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except LedgerError as error:
            print(f"dpledger: {visible(said(error))}", file=sys.stderr)
            return EXIT_FAILED
        except CliError as error:
            print(f"dpledger: {visible(str(error))}", file=sys.stderr)
            return EXIT_FAILED

    return run
