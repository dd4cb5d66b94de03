"""`dpledger silos|history|charges`: the ledger read and kept over HTTP by a person at a terminal.

Over the ledger's one typed client (`dpledger.wire.client`, httpx and pydantic, no torch): it runs
wherever the service is reachable, with any reader's key (admin or auditor; a silo key for its own
silo). Every failure is one line on stderr and exit code 2 (`terminal`), so scripts can tell "the
chain is broken" (1) from "could not ask" (2).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, TypeAdapter, ValidationError

from dpledger.people.terminal import DEFAULT_URL, CliError, ledger, reports_errors
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.numbers import budget_state, remaining_shown
from dpledger.wire.safe_text import visible
from dpledger.wire.schemas import SiloSummary

PAGE = 10_000  # the API's default page of history entries


def as_json(answer: BaseModel | Sequence[BaseModel]) -> str:
    """The API's JSON of a typed answer, as the API wrote it."""
    if isinstance(answer, BaseModel):
        return json.dumps(answer.model_dump(mode="json"), indent=2)
    return json.dumps([item.model_dump(mode="json") for item in answer], indent=2)


def number(value: float | None) -> str:
    """How the tables print ε and δ; None is the API's way of saying infinite (beyond the RDP orders)."""
    return "inf" if value is None else f"{value:.6g}"


def shown_round(index: int | None) -> str:
    """The API keeps a job's round as an index from 0; a person reads rounds from 1, as every line of
    `dpledger train`, its progress bars and a silo's log count them."""
    return "" if index is None else str(index + 1)


def remaining(silo: SiloSummary) -> float:
    spent = silo.epsilon_spent
    return 0.0 if spent is None else max(0.0, silo.epsilon - spent)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # Cells may hold text a silo chose (job ids, names): shown, never obeyed by the terminal.
    rows = [[visible(cell) for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
    return "\n".join(lines)


SILO_HEADER = ("id", "name", "ε budget", "δ", "ε spent", "remaining", "state")


def state(silo: SiloSummary) -> str:
    """in service, exhausted (what remains buys nothing), or retired at its entry: an empty cell read as unknown."""
    if silo.retired_seq is not None:
        return f"retired at entry {silo.retired_seq}"
    return "exhausted" if budget_state(spent=silo.epsilon_spent, budget=silo.epsilon) == "exhausted" else "in service"


@reports_errors
def silos_list(args: argparse.Namespace) -> int:
    with ledger() as client:
        silos = client.silos()
    if args.json:
        print(as_json(silos))
        return 0
    rows = [
        (str(s.id), s.name, number(s.epsilon), number(s.delta), number(s.epsilon_spent),
         remaining_shown(remaining=remaining(s), budget=s.epsilon), state(s))
        for s in silos
    ]
    print(table(SILO_HEADER, rows))
    return 0


DETAIL_FIELDS = (
    ("id", "id"), ("name", "name"), ("ε budget", "epsilon"), ("δ", "delta"), ("dataset size", "dataset_size"),
    ("ε spent (the gate's)", "epsilon_spent"), ("ε spent (dp-accounting, reference)", "epsilon_dp_accounting"),
    ("ε committed", "epsilon_committed"), ("ε remaining", "epsilon_remaining"), ("zCDP ρ", "rho"), ("RDP order", "order"),
)
# "the gate's": what the ledger states and charges, proven under adaptive choices. "dp-accounting,
# reference": its non-adaptive RDP ε of the same charges, which adaptive choices may exceed.


@reports_errors
def silos_create(args: argparse.Namespace) -> int:
    if (args.horizon_batch is None) != (args.horizon_noise is None):
        print("dpledger: --horizon-batch and --horizon-noise go together (the DP-SGD the silo expects to run)",
              file=sys.stderr)
        return 2
    horizon = None
    if args.horizon_batch is not None:
        # Its step count does not matter: the ledger scales the horizon until it spends the budget.
        horizon = {"type": "dpsgd", "batch_size": args.horizon_batch, "noise_multiplier": args.horizon_noise, "steps": 1}
    try:
        with ledger() as client:
            silo = client.create_silo(name=args.name, epsilon=args.epsilon, delta=args.delta,
                                      dataset_size=args.dataset_size, horizon=horizon)
    except ValidationError as error:  # the horizon is validated before it is sent
        problem = error.errors()[0]
        raise CliError(f"--horizon-batch/--horizon-noise: {'.'.join(map(str, problem['loc']))}: {problem['msg']}") from None
    if args.json:
        print(as_json(silo))
        return 0
    print(silo.api_key)  # alone on stdout, so that `export SILO1_KEY=$(dpledger silos create …)` works
    print(
        f"silo {silo.id} {silo.name!r} created: ε = {number(silo.epsilon)}, δ = {number(silo.delta)}, "
        f"dataset_size = {silo.dataset_size}; its key (above, on stdout) is shown once",
        file=sys.stderr,
    )
    return 0


@reports_errors
def silos_show(args: argparse.Namespace) -> int:
    with ledger() as client:
        silo = client.silo(args.silo_id)
    if args.json:
        print(as_json(silo))
        return 0
    width = max(len(label) for label, _ in DETAIL_FIELDS)
    for label, field in DETAIL_FIELDS:
        value = getattr(silo, field)
        shown = str(value) if field in {"id", "name", "dataset_size"} else number(value)
        print(f"{label.ljust(width)}  {shown}")
    retired = "no" if silo.retired_seq is None else f"at entry {silo.retired_seq}: {silo.retired_reason}"
    print(f"{'retired'.ljust(width)}  {visible(retired)}")
    return 0


@reports_errors
def silos_seal(args: argparse.Namespace) -> int:
    with ledger() as client:
        silo = client.seal_silo(args.silo_id)
    print(f"silo {silo.id} {silo.name!r} sealed as it stands: ε = {number(silo.epsilon)}, δ = {number(silo.delta)}, "
          f"ε spent {number(silo.epsilon_spent)}; approvals resume, and auditors still see the edit in the log")
    return 0


@reports_errors
def silos_retire(args: argparse.Namespace) -> int:
    with ledger() as client:
        silo = client.retire_silo(args.silo_id, reason=args.reason)
    print(visible(f"silo {silo.id} {silo.name!r} retired at entry {silo.retired_seq}: {silo.retired_reason}. It approves "
                  f"nothing from now on (ε spent stays {number(silo.epsilon_spent)}, nothing is refunded); reservations "
                  "made before are still committed or released; register the corrected silo under another name"))
    return 0


def _csv_pages(client: LedgerClient, silo_id: int) -> list[str]:
    # Paged by seq, so an auditor's export of a long ledger is complete, not the first page only.
    pages, after = [], 0
    while True:
        page = client.history_csv_page(silo_id, after_seq=after, limit=PAGE)
        pages.append(page)
        seqs = [int(row["seq"]) for row in csv.DictReader(io.StringIO(page))]
        if len(seqs) < PAGE:
            return pages
        after = seqs[-1]


def rounds_from_one(page: str) -> str:
    """The API's CSV with its `round` column counted from 1 (shown_round), as the table above it and
    every other line a person reads; the rest of each row as the API wrote it."""
    reader = csv.DictReader(io.StringIO(page, newline=""))
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=list(reader.fieldnames or []))  # the API's writer: csv's defaults too
    writer.writeheader()
    for row in reader:
        if row.get("round"):
            row["round"] = shown_round(int(row["round"]))
        writer.writerow(row)
    return out.getvalue()


_TIME: TypeAdapter[datetime] = TypeAdapter(datetime)


def _timestamp(at: datetime) -> str:
    return str(_TIME.dump_python(at, mode="json"))  # as the API wrote it (pydantic's ISO 8601 on both ends)


HISTORY_HEADER = ("seq", "event", "charge", "job", "round", "ε spent after (the gate's)", "dp-accounting ε (reference)", "at")


@reports_errors
def history(args: argparse.Namespace) -> int:
    with ledger() as client:
        if args.csv:
            pages = [rounds_from_one(page) for page in _csv_pages(client, args.silo_id)]
            first, *rest = [page.splitlines(keepends=True) for page in pages]
            sys.stdout.write("".join(first + [line for lines in rest for line in lines[1:]]))  # one header
            return 0
        entries, after = [], 0
        while True:  # every page, as the CSV export
            page = client.history_page(args.silo_id, after_seq=after, limit=PAGE)
            entries += page
            if len(page) < PAGE:
                break
            after = page[-1].seq
    rows = [
        (str(e.seq), e.event.value, "" if e.charge_id is None else str(e.charge_id), e.job_id or "",
         shown_round(e.round), number(e.epsilon_spent), number(e.epsilon_dp_accounting),
         _timestamp(e.created_at))
        for e in entries
    ]
    print(table(HISTORY_HEADER, rows))
    return 0


# "attempt": the first characters of the id of the attempt that made the reservation; a reserved
# charge whose worker is gone (a redelivery found it held by another attempt) waits for an operator.
CHARGE_HEADER = ("charge", "status", "job", "round", "attempt", "ε of charge", "silo ε spent")


@reports_errors
def charges_list(args: argparse.Namespace) -> int:
    with ledger() as client:
        found = client.charges(args.silo_id, status=ChargeStatus.reserved if args.open else None)
    if args.json:
        print(as_json(found))
        return 0
    rows = [
        (str(c.charge_id), c.status.value, c.job_id or "", shown_round(c.round),
         (c.attempt_id or "")[:8], number(c.epsilon), number(c.epsilon_spent))
        for c in found
    ]
    print(table(CHARGE_HEADER, rows))
    return 0


@reports_errors
def charges_release(args: argparse.Namespace) -> int:
    """Hands back a stranded reservation; the ledger refuses (409) one whose round reported any output."""
    with ledger() as client:
        settled = client.settle_charge(args.charge_id, "release")
    print(f"charge {settled.charge_id} {settled.status.value}; silo ε spent now {number(settled.epsilon_spent)}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Wires the subcommands into `dpledger`'s parser (dpledger/cli.py)."""
    env_note = f"Reads DPLEDGER_URL (default {DEFAULT_URL}) and DPLEDGER_KEY (a reader's API key)."
    admin_note = (f"Reads DPLEDGER_URL (default {DEFAULT_URL}) and DPLEDGER_KEY, which must be an admin key "
                  "(`dpledger init` prints the first).")
    silos = commands.add_parser("silos", help="register, list, show, seal or retire silos (over HTTP)", description=env_note)
    actions = silos.add_subparsers(required=True, metavar="action")
    listing = actions.add_parser("list", help="a table of every silo: budget, δ, ε spent, remaining")
    listing.add_argument("--json", action="store_true", help="the API's JSON instead of a table")
    listing.set_defaults(run=silos_list)
    create = actions.add_parser(
        "create", help="register a silo (admin key) and print its own key once",
        description=f"{admin_note} The silo's key alone goes to stdout, a summary to stderr. The ledger refuses a δ at "
        "or above 1/dataset-size: it would guarantee nothing.",
    )
    create.add_argument("name")
    create.add_argument("--epsilon", type=float, required=True, help="the silo's ε budget")
    create.add_argument("--delta", type=float, required=True, help="the silo's δ, below 1/dataset-size (e.g. 1e-5)")
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
    seal = actions.add_parser(
        "seal", help="accept a tampered silo's record as it stands (admin key), after inspecting it",
        description=f"{admin_note} The ledger refuses every approval on a silo whose record no longer matches the "
        "entries that cover it. Restore the row if you can; otherwise this writes a `seal` entry to the silo's chain "
        "and to the transparency log, which covers the record from then on (the edit stays visible to auditors).",
    )
    seal.add_argument("silo_id", type=int, metavar="ID")
    seal.set_defaults(run=silos_seal)
    retire = actions.add_parser(
        "retire", help="retire a mis-registered silo for good (admin key): it approves nothing from then on",
        description=f"{admin_note} A silo registered wrongly (its dataset size, its budget) cannot be edited. This "
        "writes a `retire` entry to its chain and to the transparency log, covering the silo and the reason; every "
        "later charge, search, plan or σ calibration on it is refused (409), while reservations made before are still "
        "committed or released. Nothing is refunded or hidden, and the name stays the retired silo's.",
    )
    retire.add_argument("silo_id", type=int, metavar="ID")
    retire.add_argument("--reason", required=True, help="why (1 to 500 characters, one line): kept in the retire entry "
                        "and quoted in every refusal")
    retire.set_defaults(run=silos_retire)

    hist = commands.add_parser("history", help="a silo's hash-chained ε history (over HTTP)", description=env_note)
    hist.add_argument("silo_id", type=int, metavar="ID")
    hist.add_argument("--csv", action="store_true", help="the API's CSV export, every page, its rounds counted from 1 "
                      "as everywhere a person reads them (the API's own CSV counts from 0)")
    hist.set_defaults(run=history)

    charges = commands.add_parser(
        "charges", help="a silo's charges; release one whose round provably never read data (over HTTP)",
        description=env_note + " An interrupted job is continued with `dpledger train JOB --resume`, which commits "
        "what may have read data and releases only what provably did not: prefer it to releasing by hand."
    )
    charge_actions = charges.add_subparsers(required=True, metavar="action")
    listed = charge_actions.add_parser("list", help="a silo's charges (admin, auditor, or that silo's key)")
    listed.add_argument("silo_id", type=int, metavar="SILO")
    listed.add_argument("--open", action="store_true", help="only open reservations (status reserved)")
    listed.add_argument("--json", action="store_true", help="the API's JSON instead of a table")
    listed.set_defaults(run=charges_list)
    freed = charge_actions.add_parser(
        "release", help="release a reservation whose round never read data (admin or the silo's key; refused once it "
        "reported). Not for an interrupted job: `dpledger train JOB --resume` settles its rounds by the settle rule"
    )
    freed.add_argument("charge_id", type=int, metavar="CHARGE_ID")
    freed.set_defaults(run=charges_release)
