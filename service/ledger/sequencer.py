"""The transparency log's sequencer: one per database, elected, restartable, in the serving processes.

Every serving process starts one (api/app.py); one of them leads, the others stand by. Leading is a
lock whose holder the operating system or the database drops when the holder dies, so a killed
leader's successor takes over without anyone cleaning up:
- PostgreSQL: a session advisory lock on one connection of the sequencer's own, kept for the
  process's life; a standby waits for the lock on it (`pg_advisory_lock`, renewed every
  LOCK_WAIT_S), so it takes over the moment the leader's session ends, however the process ended.
- SQLite: a non-blocking `flock` on a file beside the database (`<db>.sequencer-lock`), kept open and
  tried again every RETRY_S: the kernel releases it when the process dies. SQLite has one writer at
  a time anyway (db.py); the election only keeps the other workers from sequencing behind it.
Safety does not rest on the election: `transparency.sequence` locks the log's state row before it
reads the pending leaves, so two sequencers started by hand take turns and never give one index twice.

The leader sleeps until an approval's commit rings it (wakeup.py: in-process, or across processes by
a FIFO on SQLite and LISTEN/NOTIFY on PostgreSQL), lets `interval` (100 ms) pass so that the leaves
approved meanwhile share the batch, and sequences them in batches of up to `transparency.BATCH`,
again at once while batches come back full. It looks at least every FALLBACK_S even if no ring
came, so a lost ring delays a leaf, never breaks its promise (`transparency.MERGE_DELAY_MS`). What a
crash leaves pending, between an approval's commit and its batch or in the middle of a batch (rolled
back whole), is sequenced by the next leader at its start: nothing approved goes missing from the log.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from typing import IO, Any

from sqlalchemy import Connection, Engine, create_engine, event, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from dpledger.service.ledger import transparency
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.store.db import Database
from dpledger.service.store.models import LogPending
from dpledger.service.store.sqlite_url import sqlite_file
from dpledger.service.store.wakeup import LINGER_S, Wakeups, _Fifo, _Notifications, fifo_path
from dpledger.wire.receipts import SignedTreeHead

log = logging.getLogger("dpledger.sequencer")

INTERVAL_S = 0.1  # after a ring, how long the leaves approved meanwhile gather before the batch
RETRY_S = 1.0  # SQLite: how often a standby tries to lead; either: how long a leader that failed waits
# The longest a leader sleeps without a ring: a lost ring delays a leaf this much, well inside
# transparency.MERGE_DELAY_MS (60 s); at rest it costs one read of an empty table per period.
FALLBACK_S = 10.0
LOCK_WAIT_S = 60  # PostgreSQL: a standby's wait for the lock, renewed on the same connection
# PostgreSQL: the advisory lock of the sequencer (any fixed 64-bit number; "dpl-seq"), not the migrations' one.
_LOCK_KEY = int.from_bytes(b"dpl-seq", "big")
_LOCK_NOT_AVAILABLE, _QUERY_CANCELED = "55P03", "57014"  # SQLSTATEs of a wait that ended without the lock


class _Leadership:
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
                return False  # an in-memory database: no sequencer (see `runs_for`)
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
        leaders for a moment are safe (the module's docstring)."""
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


def runs_for(db: Database) -> bool:
    """An in-memory SQLite database lives in one connection of one thread: nothing to sequence from
    another thread (such a ledger serves the API's documents only: cli.py, its docs tests)."""
    url = db.engine.url
    return url.get_backend_name() != "sqlite" or sqlite_file(url) is not None


class Sequencer:
    def __init__(self, db: Database, signer: TreeHeadSigner, *, interval: float = INTERVAL_S,
                 fallback: float = FALLBACK_S) -> None:
        self._db = db
        self._signer = signer
        self._interval = interval
        self._fallback = max(fallback, interval)  # a longer interval is asked for (tests): it holds too
        self._stop = threading.Event()
        self._leadership = _Leadership(db)
        self._wakeups: Wakeups | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one batch at a time in this process (the thread, or `run_once`)
        self._busy = False  # the last batch sequenced leaves

    @property
    def leading(self) -> bool:
        return self._leadership.held

    def start(self) -> None:
        if (self._thread is not None and self._thread.is_alive()) or not runs_for(self._db):
            return
        if self._thread is None:
            # Stopped (its lock released) when the app's engine is disposed: the database is going away.
            event.listen(self._db.engine, "engine_disposed", lambda _engine: self.stop())
        self._stop.clear()
        self._wakeups = Wakeups()
        self._thread = threading.Thread(target=self._run, args=(self._wakeups,), name="dpledger-sequencer", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        """Asks the thread to end after its current batch, without waiting (safe from a finalizer)."""
        self._stop.set()
        wakeups = self._wakeups
        if wakeups is not None:
            wakeups.interrupt()

    def stop(self, timeout: float = 5.0) -> None:
        self.signal_stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            deadline = time.monotonic() + timeout
            while thread.is_alive() and time.monotonic() < deadline:
                self._leadership.interrupt()  # again, should the cancel have come before the wait began
                thread.join(0.05)
        self._leadership.release()

    def run_once(self) -> int:
        """One batch, if this process leads; returns the leaves sequenced."""
        with self._lock:
            if not self._leadership.held or not self._leadership.still_held():
                return 0
            if not self._busy:  # while batches keep coming, the next is written at once: no read first
                with self._db.read() as session:
                    if session.scalars(select(LogPending.id).limit(1)).first() is None:
                        return 0  # the common idle case: no write lock taken
            with self._db.write() as session:
                done = transparency.sequence(session, self._sign)
            self._busy = done > 0
            return done

    def _sign(self, size: int, root: str) -> SignedTreeHead:
        return self._signer.sign(tree_size=size, root_hash=root)

    def _lead(self, wakeups: Wakeups) -> bool:
        """Waits a while to lead; once this process leads, the commits ring it here."""
        if not self._leadership.acquire(self._stop):
            return False
        connection = self._leadership.dbapi_connection
        path = fifo_path(self._db.engine)
        wakeups.listen(_Notifications(connection, wakeups.heard_remote) if connection is not None
                       else _Fifo(path) if path is not None else None)
        self._db.doorbell.local = wakeups
        return True

    def _follow(self, wakeups: Wakeups) -> None:
        if self._db.doorbell.local is wakeups:
            self._db.doorbell.local = None
        wakeups.stop_listening()
        self._leadership.release()

    def _run(self, wakeups: Wakeups) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if not self._leadership.held:
                        self._follow(wakeups)
                        if not self._lead(wakeups):
                            continue
                    started = time.monotonic()
                    done = self.run_once()  # at once when it takes the lead: what a crash left pending
                    if done >= transparency.BATCH:
                        continue  # a backlog: the next batch at once
                    if started - wakeups.remote_at < LINGER_S:
                        # Another process rang lately, and rings at most every RING_EVERY_S: look
                        # again until a look began LINGER_S after its last ring (wakeup.py).
                        self._stop.wait(self._interval)
                    elif wakeups.wait(self._fallback) and not self._stop.is_set():
                        self._stop.wait(self._interval)  # the leaves approved meanwhile join the batch
                except Exception:
                    log.warning("sequencing failed; retrying in %.0f s", RETRY_S, exc_info=True)
                    self._follow(wakeups)
                    self._stop.wait(RETRY_S)
        finally:
            self._follow(wakeups)
            wakeups.close()
