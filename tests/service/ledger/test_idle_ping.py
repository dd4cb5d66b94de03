"""A pooled PostgreSQL connection is pinged only after sitting idle (store/db.py `_ping_when_idle`):
a busy pool pays no round trip per checkout, and a connection the server dropped while it was idle is
replaced before any request uses it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from dpledger.service.store import db


def _backend(engine: Any) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_connection_dropped_while_idle_is_replaced_and_a_busy_one_is_not_pinged(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(db, "IDLE_PING_S", 0.2)
    engine = db.make_engine(postgres_url)
    pings: list[object] = []
    ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda connection: pings.append(connection) or ping(connection))
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        first = _backend(engine)
        assert _backend(engine) == first and pings == []  # in use a moment ago: no ping, the same connection

        with admin.connect() as connection:  # the server drops it (a restart, an idle timeout, an operator)
            assert connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first}).scalar_one()

        time.sleep(0.3)

        replaced = _backend(engine)  # pinged, found dead, replaced: the caller never sees the error
        assert replaced != first and len(pings) == 1
        assert _backend(engine) == replaced and len(pings) == 1
    finally:
        admin.dispose()
        engine.dispose()
