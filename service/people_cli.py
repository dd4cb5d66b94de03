"""`dpledger silos|history|verify|charges`: the ledger read over HTTP by a person at a terminal.

Only httpx and the standard library: it runs wherever the service is reachable, with any reader's
key (admin or auditor; a silo key for its own silo). Every failure is one line on stderr and exit
code 2, so scripts can tell "the chain is broken" (1) from "could not ask" (2).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from dpledger.service.safe_text import visible

DEFAULT_URL = "http://127.0.0.1:8000"
PAGE = 10_000  # the API's default page of history entries
EXIT_BROKEN, EXIT_FAILED = 1, 2


class CliError(Exception):
    """Said to the person on one line; never a traceback."""


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        return response.text.strip()[:200]
    if isinstance(detail, list) and all(isinstance(d, dict) and "loc" in d for d in detail):
        # FastAPI's validation errors: the field and the reason, not the JSON
        return "; ".join(f"{'.'.join(str(p) for p in d['loc'] if p != 'body')}: {d.get('msg', '')}" for d in detail)
    return detail if isinstance(detail, str) else json.dumps(detail)


def _get(path: str, params: dict[str, Any] | None = None) -> httpx.Response:
    return _request("GET", path, params=params)


def _post(path: str, body: Any) -> httpx.Response:
    return _request("POST", path, body=body)


def _request(method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None) -> httpx.Response:
    url = os.environ.get("DPLEDGER_URL", DEFAULT_URL).rstrip("/")
    key = os.environ.get("DPLEDGER_KEY")
    if not key:
        raise CliError("DPLEDGER_KEY is not set: export an admin, auditor or silo API key")
    try:
        response = httpx.request(
            method, f"{url}{path}", params=params, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30.0
        )
    except httpx.HTTPError as error:
        raise CliError(f"cannot reach the ledger at {url} (DPLEDGER_URL): {error}") from None
    verb = "read" if method == "GET" else "write"
    if response.status_code == 401:
        raise CliError(f"401 unauthorized: DPLEDGER_KEY was refused ({_detail(response)})")
    if response.status_code == 403:
        raise CliError(f"403 forbidden: this key may not {verb} {path} ({_detail(response)})")
    if response.status_code >= 400:
        raise CliError(f"HTTP {response.status_code} from {path}: {_detail(response)}")
    return response


def _reports_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except CliError as error:
            print(f"dpledger: {visible(str(error))}", file=sys.stderr)
            return EXIT_FAILED

    return run


def number(value: float | None) -> str:
    """How the tables print ε and δ; None is the API's way of saying infinite (beyond the RDP orders)."""
    return "inf" if value is None else f"{value:.6g}"


def remaining(silo: dict[str, Any]) -> float:
    spent = silo["epsilon_spent"]
    return 0.0 if spent is None else max(0.0, silo["epsilon"] - spent)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # Cells may hold text a silo chose (job ids, names): shown, never obeyed by the terminal.
    rows = [[visible(cell) for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
    return "\n".join(lines)


SILO_HEADER = ("id", "name", "ε budget", "δ", "ε spent", "remaining")


@_reports_errors
def silos_list(args: argparse.Namespace) -> int:
    silos: list[dict[str, Any]] = _get("/v1/silos").json()
    if args.json:
        print(json.dumps(silos, indent=2))
        return 0
    rows = [
        (str(s["id"]), s["name"], number(s["epsilon"]), number(s["delta"]), number(s["epsilon_spent"]), number(remaining(s)))
        for s in silos
    ]
    print(table(SILO_HEADER, rows))
    return 0


DETAIL_FIELDS = (
    ("id", "id"), ("name", "name"), ("ε budget", "epsilon"), ("δ", "delta"), ("dataset size", "dataset_size"),
    ("ε spent", "epsilon_spent"), ("ε committed", "epsilon_committed"), ("ε remaining", "epsilon_remaining"),
    ("zCDP ρ", "rho"), ("RDP order", "order"),
)


@_reports_errors
def silos_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "epsilon": args.epsilon, "delta": args.delta, "dataset_size": args.dataset_size}
    if (args.horizon_batch is None) != (args.horizon_noise is None):
        print("dpledger: --horizon-batch and --horizon-noise go together (the DP-SGD the silo expects to run)",
              file=sys.stderr)
        return 2
    if args.horizon_batch is not None:
        # Its step count does not matter: the ledger scales the horizon until it spends the budget.
        body["horizon"] = {"type": "dpsgd", "batch_size": args.horizon_batch, "noise_multiplier": args.horizon_noise,
                           "steps": 1}
    silo: dict[str, Any] = _request("POST", "/v1/silos", body=body).json()
    if args.json:
        print(json.dumps(silo, indent=2))
        return 0
    print(silo["api_key"])  # alone on stdout, so that `export SILO1_KEY=$(dpledger silos create …)` works
    print(
        f"silo {silo['id']} {silo['name']!r} created: ε = {number(silo['epsilon'])}, δ = {number(silo['delta'])}, "
        f"dataset_size = {silo['dataset_size']}; its key (above, on stdout) is shown once",
        file=sys.stderr,
    )
    return 0


@_reports_errors
def silos_show(args: argparse.Namespace) -> int:
    silo: dict[str, Any] = _get(f"/v1/silos/{args.silo_id}").json()
    if args.json:
        print(json.dumps(silo, indent=2))
        return 0
    width = max(len(label) for label, _ in DETAIL_FIELDS)
    for label, field in DETAIL_FIELDS:
        value = silo.get(field)
        shown = str(value) if field in {"id", "name", "dataset_size"} else number(value)
        print(f"{label.ljust(width)}  {shown}")
    return 0


def _history_pages(silo_id: int, fmt: str) -> list[httpx.Response]:
    # Paged by seq, so an auditor's export of a long ledger is complete, not the first page only.
    pages, after = [], 0
    while True:
        page = _get(f"/v1/silos/{silo_id}/history", {"format": fmt, "after_seq": after, "limit": PAGE})
        pages.append(page)
        if fmt == "csv":
            seqs = [int(row["seq"]) for row in csv.DictReader(io.StringIO(page.text))]
        else:
            seqs = [entry["seq"] for entry in page.json()]
        if len(seqs) < PAGE:
            return pages
        after = seqs[-1]


HISTORY_HEADER = ("seq", "event", "charge", "job", "round", "ε spent after", "at")


@_reports_errors
def history(args: argparse.Namespace) -> int:
    if args.csv:
        pages = _history_pages(args.silo_id, "csv")
        first, *rest = [page.text.splitlines(keepends=True) for page in pages]
        sys.stdout.write("".join(first + [line for lines in rest for line in lines[1:]]))  # one header
        return 0
    entries = [e for page in _history_pages(args.silo_id, "json") for e in page.json()]
    rows = [
        (str(e["seq"]), e["event"], "" if e["charge_id"] is None else str(e["charge_id"]), e["job_id"] or "",
         "" if e["round"] is None else str(e["round"]), number(e["epsilon_spent"]), e["created_at"])
        for e in entries
    ]
    print(table(HISTORY_HEADER, rows))
    return 0


@_reports_errors
def verify(args: argparse.Namespace) -> int:
    if getattr(args, "receipts", None) is not None:
        from dpledger.service import transparency_cli

        return transparency_cli.verify_receipts_command(args)
    report: dict[str, Any] = _get("/v1/audit/verify").json()
    if report["ok"]:
        print(f"ok: {report['entries']} entries, every hash recomputes")
        return 0
    print(
        f"BROKEN: {report['entries']} entries; first bad entry seq {report['first_bad_seq']} "
        f"of silo {report['first_bad_silo_id']}; edited charges {report['bad_charge_ids']}"
    )
    for problem in report["problems"]:
        print(f"  - {problem}")
    return EXIT_BROKEN


# "attempt": the first characters of the id of the attempt that made the reservation; a reserved
# charge whose worker is gone (a redelivery found it held by another attempt) waits for an operator.
CHARGE_HEADER = ("charge", "status", "job", "round", "attempt", "ε of charge", "silo ε spent")


@_reports_errors
def charges_list(args: argparse.Namespace) -> int:
    params = {"status": "reserved"} if args.open else None
    found: list[dict[str, Any]] = _get(f"/v1/silos/{args.silo_id}/charges", params).json()
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    rows = [
        (str(c["charge_id"]), c["status"], c["job_id"] or "", "" if c["round"] is None else str(c["round"]),
         (c.get("attempt_id") or "")[:8], number(c["epsilon"]), number(c["epsilon_spent"]))
        for c in found
    ]
    print(table(CHARGE_HEADER, rows))
    return 0


@_reports_errors
def charges_release(args: argparse.Namespace) -> int:
    """Hands back a stranded reservation; the ledger refuses (409) one whose round reported any output."""
    settled = _request("POST", f"/v1/charges/{args.charge_id}/release").json()
    print(f"charge {settled['charge_id']} {settled['status']}; silo ε spent now {number(settled['epsilon_spent'])}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Wires the subcommands into `dpledger`'s parser (service/cli.py)."""
    env_note = f"Reads DPLEDGER_URL (default {DEFAULT_URL}) and DPLEDGER_KEY (a reader's API key)."
    silos = commands.add_parser("silos", help="list or show silos' budgets (over HTTP)", description=env_note)
    actions = silos.add_subparsers(required=True, metavar="action")
    listing = actions.add_parser("list", help="a table of every silo: budget, δ, ε spent, remaining")
    listing.add_argument("--json", action="store_true", help="the API's JSON instead of a table")
    listing.set_defaults(run=silos_list)
    create = actions.add_parser(
        "create", help="register a silo (admin key) and print its own key once",
        description=f"{env_note} The silo's key alone goes to stdout, a summary to stderr.",
    )
    create.add_argument("name")
    create.add_argument("--epsilon", type=float, required=True, help="the silo's ε budget")
    create.add_argument("--delta", type=float, required=True, help="the silo's δ")
    create.add_argument("--dataset-size", type=int, required=True, help="records the silo trains on (q = B / this)")
    create.add_argument("--horizon-batch", type=int, metavar="B",
                        help="with --horizon-noise: the DP-SGD batch the silo expects to train with; its filter is "
                        "tightest for that workload (default: 256 or 1%% of the set)")
    create.add_argument("--horizon-noise", type=float, metavar="SIGMA", help="the noise multiplier of that DP-SGD")
    create.add_argument("--json", action="store_true", help="the API's JSON (key included) instead")
    create.set_defaults(run=silos_create)
    show = actions.add_parser("show", help="one silo's budget in detail")
    show.add_argument("silo_id", type=int, metavar="ID")
    show.add_argument("--json", action="store_true", help="the API's JSON instead of a table")
    show.set_defaults(run=silos_show)

    hist = commands.add_parser("history", help="a silo's hash-chained ε history (over HTTP)", description=env_note)
    hist.add_argument("silo_id", type=int, metavar="ID")
    hist.add_argument("--csv", action="store_true", help="the API's CSV export, every page")
    hist.set_defaults(run=history)

    charges = commands.add_parser(
        "charges", help="a silo's charges; release a stranded reservation (over HTTP)", description=env_note
    )
    charge_actions = charges.add_subparsers(required=True, metavar="action")
    listed = charge_actions.add_parser("list", help="a silo's charges (admin, auditor, or that silo's key)")
    listed.add_argument("silo_id", type=int, metavar="SILO")
    listed.add_argument("--open", action="store_true", help="only open reservations (status reserved)")
    listed.add_argument("--json", action="store_true", help="the API's JSON instead of a table")
    listed.set_defaults(run=charges_list)
    freed = charge_actions.add_parser(
        "release", help="release a reservation whose round never ran (admin or the silo's key; refused once it reported)"
    )
    freed.add_argument("charge_id", type=int, metavar="CHARGE_ID")
    freed.set_defaults(run=charges_release)

    check = commands.add_parser("verify", help="recompute the audit chain, or check held receipts; exit 1 if broken (over HTTP)",
                                description=env_note)
    check.set_defaults(run=verify)

    from dpledger.service import transparency_cli  # the log's commands: `verify --receipts`, `audit`, `pubkey`

    transparency_cli.add_commands(commands, check)
