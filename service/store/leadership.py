"""The election of the transparency log's sequencer (ledger/sequencer.py): one leader per database.

Leading is a lock whose holder the operating system or the database drops when the holder dies, so a
killed leader's successor takes over without anyone cleaning up:
- PostgreSQL: a session advisory lock on one connection of the sequencer's own, kept for the
  process's life; a standby waits for the lock on it (`pg_advisory_lock`, renewed every
  LOCK_WAIT_S), so it takes over the moment the leader's session ends, however the process ended.
- SQLite: a non-blocking `flock` on a file beside the database (`<db>.sequencer-lock`), kept open and
  tried again every RETRY_S: the kernel releases it when the process dies. SQLite has one writer at
  a time anyway (db.py); the election only keeps the other workers from sequencing behind it.
An in-memory SQLite database has no sequencer (`has_sequencer`).
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from dpledger.service.store.db import Database
from dpledger.service.store.sqlite_url import sqlite_file

log = logging.getLogger("dpledger.sequencer")

RETRY_S = 1.0  # SQLite: how often a standby tries to lead; either: how long a leader that failed waits
LOCK_WAIT_S = 60  # PostgreSQL: a standby's wait for the lock, renewed on the same connection
# PostgreSQL: the advisory lock of the sequencer (any fixed 64-bit number; "dpl-seq"), not the migrations' one.
_LOCK_KEY = int.from_bytes(b"dpl-seq", "big")
_LOCK_NOT_AVAILABLE, _QUERY_CANCELED = "55P03", "57014"  # SQLSTATEs of a wait that ended without the lock


def has_sequencer(db: Database) -> bool:
    """An in-memory SQLite database lives in one connection of one thread: nothing to sequence from
    another thread (such a ledger serves the API's documents only: cli.py, its docs tests)."""
    url = db.engine.url
    return url.get_backend_name() != "sqlite" or sqlite_file(url) is not None


def when_disposed(db: Database, then: Callable[[], object]) -> None:
    """Calls `then()` when the database's engine is disposed: the database is going away."""
    event.listen(db.engine, "engine_disposed", lambda _engine: then())


class Leadership:
    """Whether this process leads the database's sequencing. `acquire` waits a while for the lead
    (SQLite: one try, then RETRY_S; PostgreSQL: on the lock itself, up to LOCK_WAIT_S); `interrupt`
    ends that wait from another thread."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._held = False
        self._file: IO[bytes] | None = None
        self._engine: Engine | None = None
        self._connection: Connection | None = None  # PostgreSQL: the lock's, kept across tries
        self._waiting = False
        self._checked = 0.0  # when the lock's connection last answered
        database = db.engine.url.database
        self.dialect = db.engine.dialect.name
        self._path = f"{database}.sequencer-lock" if self.dialect == "sqlite" and database else None

    @property
    def held(self) -> bool:
        return self._held

    @property
    def dbapi_connection(self) -> Any:
        """PostgreSQL: psycopg's connection that holds the lock (the leader LISTENs on it)."""
        return None if self._connection is None else self._connection.connection.dbapi_connection

    def acquire(self, stop: threading.Event) -> bool:
        if self._held:
            return True
        if self.dialect == "sqlite":
            if self._path is None:
                return False  # an in-memory database: no sequencer (see `has_sequencer`)
            if self._file is None:
                self._file = open(self._path, "ab")
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                stop.wait(RETRY_S)
                return False
            self._held = True
            return True
        connection = self._lock_connection()
        self._waiting = True
        try:
            if stop.is_set():
                return False
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _LOCK_KEY})
        except DBAPIError as error:
            if getattr(error.orig, "sqlstate", None) in (_LOCK_NOT_AVAILABLE, _QUERY_CANCELED):
                return False  # LOCK_WAIT_S passed, or a stop: the connection is still good
            self.release()
            raise
        finally:
            self._waiting = False
        self._held, self._checked = True, time.monotonic()
        return True

    def _lock_connection(self) -> Connection:
        if self._connection is None:
            if self._engine is None:
                # TCP keepalives: a standby waits on this connection for minutes; a network that
                # dropped it silently must not leave it waiting forever.
                self._engine = create_engine(self._db.engine.url, poolclass=NullPool, connect_args={
                    "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3})
            connection = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            connection.exec_driver_sql(f"SET lock_timeout = '{LOCK_WAIT_S}s'")
            self._connection = connection
        return self._connection

    def interrupt(self) -> None:
        """Ends a standby's wait for the PostgreSQL lock now (from another thread)."""
        connection = self.dbapi_connection
        if self._waiting and connection is not None:
            try:
                connection.cancel()
            except Exception:
                log.debug("cancelling the sequencer's wait for its lock failed", exc_info=True)

    def still_held(self) -> bool:
        """PostgreSQL: the lock lives as long as its connection: a dropped one means another may lead
        now. Asked at most every RETRY_S while the leader works (at rest, the leader's poll on that
        connection notices a drop): a busy leader's batch is then not one round trip longer, and two
        leaders for a moment are safe (ledger/sequencer.py's docstring)."""
        if not self._held or self._connection is None:
            return self._held
        if time.monotonic() - self._checked < RETRY_S:
            return True
        try:
            self._connection.execute(text("SELECT 1"))
            self._checked = time.monotonic()
            return True
        except Exception:
            self.release()
            return False

    def release(self) -> None:
        """Gives the lead up (SQLite: the flock; PostgreSQL: the session, and with it the lock)."""
        self._held = False
        if self._file is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            finally:
                self._file.close()
                self._file = None
        if self._connection is not None:
            try:
                self._connection.close()  # ends the session: the server drops its advisory lock
            except Exception:
                log.debug("the sequencer's lock connection was already gone")
            self._connection = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
