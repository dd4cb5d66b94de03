"""Raw SQL on a test's ledger, as an operator with the database would run it (the tamper tests)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Connection, Engine, text

from tests.conftest import ADMIN


def sql(engine: Engine, statement: str, **params: Any) -> Any:
    with engine.begin() as connection:
        return connection.execute(text(statement), params)


def entries(engine: Engine) -> int:
    return int(sql(engine, "SELECT count(*) FROM ledger_entries").scalar_one())


def charge_curve(connection: Connection, charge_id: int) -> str:
    """The curve text a charge reads, through its key into the curves table (store/curves.py)."""
    return str(connection.execute(text("SELECT curves.rdp FROM charges JOIN curves ON curves.hash = charges.curve_hash "
                                       "WHERE charges.id = :id"), {"id": charge_id}).scalar_one())


def repoint_curve(connection: Connection, charge_id: int, forged: str) -> Callable[[Connection], None]:
    """What an edit of one charge's curve is, now that charges share curve rows: a row of the forger's own,
    keyed as the ledger keys one (its text's SHA-256), and the charge pointed at it. Returns the undo."""
    old = connection.execute(text("SELECT curve_hash FROM charges WHERE id = :id"), {"id": charge_id}).scalar_one()
    key = hashlib.sha256(forged.encode()).hexdigest()
    if connection.execute(text("SELECT count(*) FROM curves WHERE hash = :h"), {"h": key}).scalar_one() == 0:
        connection.execute(text("INSERT INTO curves (hash, rdp) VALUES (:h, :t)"), {"h": key, "t": forged})
    connection.execute(text("UPDATE charges SET curve_hash = :h WHERE id = :id"), {"h": key, "id": charge_id})
    return lambda c: c.execute(text("UPDATE charges SET curve_hash = :h WHERE id = :id"), {"h": old, "id": charge_id})


def logged(client: TestClient, engine: Engine) -> None:
    """Waits (bounded) until the sequencer has every entry in the log's signed head: an auditor reads the head."""
    deadline = time.monotonic() + 30
    while client.get("/v1/log/head", headers=ADMIN).json()["tree_size"] < entries(engine):
        assert time.monotonic() < deadline, "the sequencer did not log every entry within 30 s"
        time.sleep(0.05)
