"""What a charge costs at rest: bytes of database per charge, reserved then committed through the real
app (`create_app`, in-process over its ASGI interface) on one silo that repeats one (q, σ) pair, as a
federated job does, with its transparency log sequenced (leaves, nodes and heads count too).

    python bench/storage.py                    # SQLite, then PostgreSQL if 127.0.0.1:5432 answers
    python bench/storage.py --charges 5000 --no-postgres

SQLite: the pages in use ((page_count − freelist_count) × page_size) after a WAL checkpoint, before
and after the charges. PostgreSQL: `pg_total_relation_size` (heap, indexes, TOAST) summed over the
ledger's tables, before and after (the bench drops and recreates schema `public`). Both measure the
growth from a silo that holds one charge already (its filter fixed, its pair priced), so registration
is left out. On PostgreSQL it also prints the size once `VACUUM FULL` dropped the dead row versions
(the silo row's running sums, rewritten by every approval, are most of the raw growth): what the
charges hold at rest, as SQLite's count of pages in use (its free pages left out) is. Prints one line
per database, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text

from dpledger.service.api.app import create_app
from dpledger.service.settings import Settings
from dpledger.service.store.db import migrate
from dpledger.service.store.models import Base

from _harness import json_safe, log, postgres_answers, reset_postgres, wait_sequenced

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
STEP = {"type": "dpsgd", "batch_size": 256, "noise_multiplier": 1.1, "steps": 1}
SILO = {"name": "storage", "epsilon": 1e4, "delta": 1e-5, "dataset_size": 60_000}


def sqlite_bytes(engine: Engine) -> int:
    """Bytes of the pages in use, once the WAL is folded into the file (its frames are not the file's)."""
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size, pages, free = (int(connection.exec_driver_sql(f"PRAGMA {name}").scalar_one())
                                  for name in ("page_size", "page_count", "freelist_count"))
    return (pages - free) * page_size


def postgres_bytes(engine: Engine) -> int:
    """Heap, indexes and TOAST of every ledger table that exists at this tree's schema."""
    with engine.connect() as connection:
        present = set(connection.execute(text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars())
        tables = sorted(present & (set(Base.metadata.tables) | {"curves"}))
        return int(sum(connection.execute(text("SELECT pg_total_relation_size(:t)"), {"t": table}).scalar_one()
                       for table in tables))


def vacuum_full(engine: Engine) -> None:
    """PostgreSQL: every ledger table rewritten with its live rows only. An approval updates its silo's row
    (the running sums, ~3.3 KB of text each, TOASTed) and a commit its charge's: the dead versions take
    space that autovacuum hands back for reuse but never returns, so the growth before this is the churn
    of a busy spell and the size after it what the charges hold at rest."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.exec_driver_sql("VACUUM FULL")


def measure(url: str, charges: int) -> dict[str, Any]:
    """Bytes per reserve + commit of `charges` charges of one repeated pair on the ledger at `url`."""
    migrate(url)
    app = create_app(Settings(database_url=url, admin_key=ADMIN_KEY))
    engine = create_engine(url)
    size = sqlite_bytes if engine.dialect.name == "sqlite" else postgres_bytes
    try:
        with TestClient(app) as client:
            made = client.post("/v1/silos", json=SILO, headers=ADMIN)
            assert made.status_code == 201, made.text
            silo_id, headers = made.json()["id"], {"Authorization": f"Bearer {made.json()['api_key']}"}

            def charge(i: int) -> None:
                reserved = client.post(f"/v1/silos/{silo_id}/charges", headers=headers, json={
                    "mechanism": STEP, "idempotency_key": f"k{i}", "job_id": "storage", "round": i})
                assert reserved.status_code == 201, reserved.text
                committed = client.post(f"/v1/charges/{reserved.json()['charge_id']}/commit", headers=headers)
                assert committed.status_code == 200, committed.text

            charge(0)  # fixes the filter and prices the pair: what every later charge finds done
            wait_sequenced(engine)
            postgres = engine.dialect.name == "postgresql"
            if postgres:
                vacuum_full(engine)
            before, started = size(engine), time.perf_counter()
            for i in range(1, charges + 1):
                charge(i)
                if i % 500 == 0:
                    log(f"{engine.dialect.name}: {i} charges")
            wait_sequenced(engine)
            seconds = time.perf_counter() - started
            after = size(engine)
        if postgres:  # the server's connections closed: nothing holds a table's lock
            app.state.engine.dispose()
            vacuum_full(engine)
        at_rest = size(engine)
    finally:
        app.state.engine.dispose()
        engine.dispose()
    per_charge, at_rest_per_charge = (after - before) / charges, (at_rest - before) / charges
    return {"database": engine.dialect.name, "charges": charges, "bytes_before": before, "bytes_after": after,
            "bytes_per_charge": per_charge, "kb_per_charge": per_charge / 1024, "bytes_at_rest": at_rest,
            "kb_per_charge_at_rest": at_rest_per_charge / 1024, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--charges", type=int, default=2000, help="charges measured, each reserved and committed")
    parser.add_argument("--pg-url", default=os.environ.get("DPLEDGER_BENCH_POSTGRES_URL", DEFAULT_PG_URL))
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="dpledger-storage-") as folder:
        runs.append(measure(f"sqlite:///{folder}/ledger.db", args.charges))
    if not args.no_postgres and postgres_answers(args.pg_url):
        reset_postgres(args.pg_url)
        runs.append(measure(args.pg_url, args.charges))
    elif not args.no_postgres:
        log(f"PostgreSQL at {args.pg_url} does not answer: skipped")
    for run in runs:
        vacuumed = (f", {run['kb_per_charge_at_rest']:.2f} KB after VACUUM FULL" if run["database"] == "postgresql"
                    else "")
        print(f"{run['database']:>10}: {run['kb_per_charge']:.2f} KB per charge{vacuumed} (reserve + commit, "
              f"{run['charges']} charges of one pair; {run['bytes_before']:,} → {run['bytes_after']:,} bytes, "
              f"{run['seconds']:.0f} s)")
    print(json.dumps(json_safe({"config": vars(args), "runs": runs}), allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
