"""Raw SQL on a test's ledger, as an operator with the database would run it (the tamper tests)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, text


def sql(engine: Engine, statement: str, **params: Any) -> Any:
    with engine.begin() as connection:
        return connection.execute(text(statement), params)


def entries(engine: Engine) -> int:
    return int(sql(engine, "SELECT count(*) FROM ledger_entries").scalar_one())
