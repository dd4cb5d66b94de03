"""The transparency log's sequencer: one per database, elected, restartable, in the serving processes.

Every serving process starts one (api/app.py); one of them leads, the others stand by and try again
every second. Leading is a lock whose holder the operating system or the database drops when the
holder dies, so a killed leader's successor takes over without anyone cleaning up:
- PostgreSQL: a session advisory lock (`pg_try_advisory_lock`) on a connection of the sequencer's
  own; the server releases it when that connection ends, however the process ended.
- SQLite: a non-blocking `flock` on a file beside the database (`<db>.sequencer-lock`): the kernel
  releases it when the process dies. SQLite has one writer at a time anyway (db.py); the election
  only keeps the other workers from polling for work they would queue behind.
Safety does not rest on the election: `transparency.sequence` locks the log's state row before it
reads the pending leaves, so two sequencers started by hand take turns and never give one index twice.

The leader looks for pending leaves every `interval` (100 ms) and sequences them in batches of up
to `transparency.BATCH`, again at once while batches come back full. What a crash leaves pending,
between an approval's commit and its batch or in the middle of a batch (rolled back whole), is
sequenced by the next leader: nothing approved goes missing from the log.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from typing import IO

from sqlalchemy import Connection, create_engine, event, select, text
from sqlalchemy.pool import NullPool

from dpledger.service.ledger import transparency
from dpledger.service.ledger.db import Database
from dpledger.service.ledger.models import LogPending
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.wire.receipts import SignedTreeHead

log = logging.getLogger("dpledger.sequencer")

INTERVAL_S = 0.1  # the most a leaf waits for its batch while a leader runs
RETRY_S = 1.0  # how often a standby tries to lead, and how long a leader that failed waits
# PostgreSQL: the advisory lock of the sequencer (any fixed 64-bit number; "dpl-seq"), not the migrations' one.
_LOCK_KEY = int.from_bytes(b"dpl-seq", "big")


class _Leadership:
    """Whether this process leads the database's sequencing; `try_take` is cheap to repeat."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._held = False
        self._file: IO[bytes] | None = None
        self._connection: Connection | None = None
        self._checked = 0.0  # when the lock's connection last answered
        database = db.engine.url.database
        self.dialect = db.engine.dialect.name
        self._path = f"{database}.sequencer-lock" if self.dialect == "sqlite" and database else None

    @property
    def held(self) -> bool:
        return self._held

    def try_take(self) -> bool:
        if self._held:
            return True
        if self.dialect == "sqlite":
            if self._path is None:
                return False  # an in-memory database: no sequencer (see `runs_for`)
            self._file = open(self._path, "ab")
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.close()
                self._file = None
                return False
            self._held = True
        else:
            engine = create_engine(self._db.engine.url, poolclass=NullPool)
            connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            if connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": _LOCK_KEY}).scalar_one():
                self._connection, self._held, self._checked = connection, True, time.monotonic()
            else:
                connection.close()
            engine.dispose()
        return self._held

    def still_held(self) -> bool:
        """PostgreSQL: the lock lives as long as its connection: a dropped one means another may lead
        now. Asked at most every RETRY_S, as a standby tries to lead: a busy leader's batch is then not
        one round trip longer, and two leaders for a moment are safe (the module's docstring)."""
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


def runs_for(db: Database) -> bool:
    """An in-memory SQLite database lives in one connection of one thread: nothing to sequence from
    another thread (such a ledger serves the API's documents only: cli.py, its docs tests)."""
    url = db.engine.url
    if url.get_backend_name() != "sqlite":
        return True
    database = url.database or ""
    return bool(database) and database != ":memory:" and not database.startswith("file::memory:") \
        and "mode=memory" not in str(url)


class Sequencer:
    def __init__(self, db: Database, signer: TreeHeadSigner, *, interval: float = INTERVAL_S) -> None:
        self._db = db
        self._signer = signer
        self._interval = interval
        self._stop = threading.Event()
        self._leadership = _Leadership(db)
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
        self._thread = threading.Thread(target=self._run, name="dpledger-sequencer", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        """Asks the thread to end after its current batch, without waiting (safe from a finalizer)."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._leadership.release()

    def run_once(self) -> int:
        """One batch, if this process leads (or can take the lead now); returns the leaves sequenced."""
        with self._lock:
            if not self._leadership.try_take() or not self._leadership.still_held():
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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                done = self.run_once()
            except Exception:
                log.warning("sequencing failed; retrying in %.0f s", RETRY_S, exc_info=True)
                self._leadership.release()
                self._stop.wait(RETRY_S)
                continue
            if done >= transparency.BATCH:
                continue  # a backlog: the next batch at once
            self._stop.wait(self._interval if self._leadership.held else RETRY_S)
        self._leadership.release()
