"""The stack's floor: what any FastAPI service pays for one approval-shaped request, for benches to
measure dpledger against in the same run (`bench/approvals.py --floor`).

One route, the approval's: it validates a pydantic body of the approval's shape, then does one
INSERT and COMMIT on its database (SQLite in WAL with synchronous=FULL, as the ledger runs it; or
PostgreSQL through psycopg), on a connection its worker thread keeps, and answers 201 with the row's
id. Nothing else: no authentication, accounting, chain or log. Served by uvicorn as the ledger is
(`python -m uvicorn --factory _floor:make_app`, with FLOOR_DATABASE_URL set; run from bench/).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field
from sqlalchemy import make_url


class Step(BaseModel):
    type: Literal["dpsgd"]
    batch_size: int = Field(gt=0)
    noise_multiplier: float = Field(gt=0)
    steps: int = Field(gt=0)


class Approval(BaseModel):
    mechanism: Step
    idempotency_key: str = Field(min_length=1, max_length=200)
    job_id: str | None = None
    round: int | None = None


_SCHEMA = "CREATE TABLE IF NOT EXISTS floor_charges (id {id}, silo_id INTEGER NOT NULL, idempotency_key TEXT NOT NULL, " \
          "mechanism TEXT NOT NULL, UNIQUE (silo_id, idempotency_key))"


def make_app() -> FastAPI:
    url = make_url(os.environ["FLOOR_DATABASE_URL"])
    local = threading.local()
    postgres = url.get_backend_name() == "postgresql"

    def connection() -> Any:
        found = getattr(local, "connection", None)
        if found is None:
            if postgres:
                import psycopg

                found = psycopg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False))
            else:
                found = sqlite3.connect(url.database or ":memory:", check_same_thread=False)
                found.execute("PRAGMA journal_mode=WAL")
                found.execute("PRAGMA synchronous=FULL")
            local.connection = found
        return found

    setup = connection()
    setup.execute(_SCHEMA.format(id="BIGSERIAL PRIMARY KEY" if postgres else "INTEGER PRIMARY KEY"))
    setup.commit()
    app = FastAPI()

    @app.post("/v1/silos/{silo_id}/charges", status_code=201)
    def approve(silo_id: int, body: Approval) -> dict[str, int]:
        conn = connection()
        row = conn.execute(
            "INSERT INTO floor_charges (silo_id, idempotency_key, mechanism) VALUES (%s, %s, %s) RETURNING id" if postgres
            else "INSERT INTO floor_charges (silo_id, idempotency_key, mechanism) VALUES (?, ?, ?) RETURNING id",
            (silo_id, body.idempotency_key, body.mechanism.model_dump_json()),
        ).fetchone()
        conn.commit()
        return {"charge_id": int(row[0])}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
