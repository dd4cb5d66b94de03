"""Engine and transactions. SQLite: WAL, synchronous=FULL, BEGIN IMMEDIATE for writes.
PostgreSQL: row locks (`SELECT … FOR UPDATE`) taken by the ledger."""

from __future__ import annotations

import fcntl
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO

from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, NullPool, Pool

import dpledger.migrations
from dpledger.service.store import curves
from dpledger.service.store.sqlite_url import sqlite_file
from dpledger.service.store.wakeup import Doorbell

MIGRATIONS_DIR = Path(dpledger.migrations.__file__).resolve().parent
_IMMEDIATE = "dpledger_immediate"
_written = threading.local()  # per thread: whether the write under way has written a pending leaf of the log


def leaf_written() -> None:
    """Says that the write under way in this thread wrote a pending leaf of the transparency log
    (transparency.pending_leaf): its commit then rings the log's sequencer (wakeup.py), which
    otherwise sleeps."""
    _written.leaf = True


def _leaf_committed() -> bool:
    if getattr(_written, "leaf", False):
        _written.leaf = False
        return True
    return False


class SqliteWriters:
    """A thread lock for the writers of this process, then an flock on a file beside the database
    for those of the other processes (`serve --workers N`); flock is per open file, so threads of
    one process need the thread lock in front of it."""

    def __init__(self, database: str | None) -> None:
        """`database`: the SQLite file (sqlite_file), None in memory."""
        self._threads = threading.Lock()
        self._path = None if database is None else f"{database}.writer-lock"
        self._file: IO[bytes] | None = None

    @property
    def on_file(self) -> bool:
        return self._path is not None

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            if self._path is not None:
                if self._file is None:
                    self._file = open(self._path, "ab")
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *_: object) -> None:
        try:
            if self._file is not None:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        finally:
            self._threads.release()


# SQLite: at most this many writers share one COMMIT (each waits for it: a bound on its wait).
GROUP_AT_MOST = 32


class CommitFailed(RuntimeError):
    """The COMMIT of a group of writes failed: none of them is in the database."""


class _Outcome:
    def __init__(self) -> None:
        self._settled = threading.Event()
        self._error: BaseException | None = None

    def settle(self, error: BaseException | None) -> None:
        self._error = error
        self._settled.set()

    def wait(self) -> None:
        self._settled.wait()
        if self._error is not None:  # each writer raises its own exception: they run in other threads
            raise CommitFailed(f"the transaction that held this write failed: {self._error}") from self._error


class GroupCommit:
    """SQLite: the writes of this process that queue behind one another share one transaction and
    one fsync (group commit, as PostgreSQL and InnoDB do for their own logs), each in a savepoint of
    its own, so that a writer's error undoes its changes only. A writer returns only once the COMMIT
    that holds its changes has returned: nothing is answered before it is durable. The write lock
    (SqliteWriters) is held from the group's first write to its COMMIT; the last writer in the
    queue, or the GROUP_AT_MOST-th, commits.

    The groups run one after another on one connection, kept between them: taking it from the pool
    and handing it back (a rollback to reset it, the pool's events) cost each write, the sequencer's
    batches included, about as much as its BEGIN and COMMIT (docs/benchmarks.md). A connection whose
    group failed is closed and the next group takes a new one, as it does once the engine's pool is
    replaced (engine.dispose)."""

    def __init__(self, engine: Engine, writers: SqliteWriters, *, at_most: int = GROUP_AT_MOST) -> None:
        self._engine = engine
        self._writers = writers
        self._at_most = at_most
        self._turn = threading.Lock()  # one writer of this process at a time
        self._queued = 0  # writers of this process waiting for their turn
        self._counting = threading.Lock()
        self._connection: Connection | None = None  # the group's, from its first write to its COMMIT
        self._kept: Connection | None = None  # the connection the groups run on, between them too
        self._kept_pool: Pool | None = None  # the engine's pool it came from
        self._members: list[_Outcome] = []

    @contextmanager
    def session(self, sessions: sessionmaker[Session]) -> Iterator[Session]:
        with self._counting:
            self._queued += 1
        self._turn.acquire()
        with self._counting:
            self._queued -= 1
        outcome = _Outcome()
        try:
            # The group's first writer needs no savepoint (two statements more): its error rolls
            # back the whole transaction, which holds its changes only.
            first = self._connection is None
            session = sessions(bind=self._open(), join_transaction_mode="rollback_only" if first else "create_savepoint")
            try:
                yield session
                session.commit()  # a flush into the group's transaction; after the first, RELEASE SAVEPOINT
            except BaseException:
                try:
                    session.rollback()  # the first: ROLLBACK; after it, ROLLBACK TO SAVEPOINT (its own changes)
                except BaseException as broken:
                    self._end(broken)  # the transaction itself is lost: so is every write in it
                    raise
                if first:
                    self._end(None)  # rolled back: nothing to commit
                raise
            finally:
                session.close()
            self._members.append(outcome)
        finally:
            try:
                if self._connection is not None and (self._queued == 0 or len(self._members) >= self._at_most):
                    self._end(None)
            finally:
                self._turn.release()
        outcome.wait()

    def _open(self) -> Connection:
        if self._connection is None:
            self._writers.__enter__()
            try:
                # Kept while it is the engine's pool's: an engine disposed of (engine.dispose, a new
                # pool) gets new connections, this one included.
                if self._kept is None or self._kept.invalidated or self._kept_pool is not self._engine.pool:
                    self._discard()
                    self._kept, self._kept_pool = self._engine.connect(), self._engine.pool
                    self._kept.execution_options(**{_IMMEDIATE: True})
                connection = self._kept
                connection.begin()
            except BaseException:
                self._discard()
                self._writers.__exit__()
                raise
            self._connection = connection
        return self._connection

    def _discard(self) -> None:
        """Closes the kept connection (its group failed, or the database is disposed of)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()

    def close(self) -> None:
        """Closes the kept connection once no group holds it (Database.dispose)."""
        with self._turn:
            if self._connection is None:
                self._discard()

    def _end(self, error: BaseException | None) -> None:
        """COMMIT the group (or, given the error that lost it, roll it back) and settle its writers."""
        connection, members = self._connection, self._members
        assert connection is not None
        self._connection, self._members = None, []
        try:
            if error is not None:
                connection.invalidate()
            elif connection.in_transaction():
                connection.commit()
        except BaseException as failed:
            error = failed
            connection.invalidate()
        finally:
            if error is not None:
                self._discard()
            self._writers.__exit__()
        for member in members:
            member.settle(error)


def database_url(session: Session) -> object:
    """The URL of the database `session` reads: a write session may be bound to a connection, a read one
    to an engine with options."""
    bind = session.get_bind()
    return (bind.engine if isinstance(bind, Connection) else bind).url


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # A pool as large as the threads that may hold a session at once (anyio's threadpool is 40
        # threads, and the sequencer), so that a burst of requests does not open and close
        # connections, each running the PRAGMAs below.
        # (An in-memory database has one connection per thread, SingletonThreadPool, and no such sizes.)
        in_memory = sqlite_file(url) is None
        # LIFO: the connections of a quiet spell are the last ones used, still hot in every cache.
        pool = {} if in_memory else {"pool_size": 20, "max_overflow": 30, "pool_use_lifo": True}
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False}, **pool)
        _configure_sqlite(engine)
        return engine
    engine = create_engine(url, pool_size=10, max_overflow=20, pool_use_lifo=True)
    _ping_when_idle(engine)
    return engine


# A pooled PostgreSQL connection is pinged at checkout only after this long unused.
IDLE_PING_S = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's pool_pre_ping, for connections that sat idle: pinging at every checkout cost an
    approval ~85 µs of CPU and a round trip (measured), most of the server's work on a busy pool,
    whose connections a restarted PostgreSQL would break mid-use all the same. One idle for
    IDLE_PING_S is pinged, and a dead one replaced before any request sees it (the pool retries a
    checkout that raises DisconnectionError with a new connection)."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: object, record: ConnectionPoolEntry) -> None:
        record.info["checked_in"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: DBAPIConnection, record: ConnectionPoolEntry, _proxy: object) -> None:
        idle_since = record.info.get("checked_in")
        if idle_since is None or time.monotonic() - idle_since < IDLE_PING_S:
            return  # just connected, or in use a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            raise DisconnectionError(f"a pooled connection idle for {IDLE_PING_S} s no longer answers") from error


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        # Let SQLAlchemy emit BEGIN itself, so that writes can ask for BEGIN IMMEDIATE.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # An approval that was answered must survive a crash, or a silo could spend twice.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        # A deferred transaction that reads, then writes, can fail with SQLITE_BUSY_SNAPSHOT when
        # another writer got in between; IMMEDIATE takes the write lock up front and waits for it.
        immediate = connection.get_execution_options().get(_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class Database:
    """The ledger's one way to its database: `read()` for a session that only reads, `write()` for
    one transaction that holds the write lock from its first statement and commits on exit. Every
    write of the service goes through `write()`, so SQLite sees one writer at a time, queued on
    locks that wake the next writer at once: SQLite's own busy handler makes a waiting writer sleep
    in growing steps (up to 100 ms), so writers that meet only at SQLite's lock approve in bursts,
    with a p99 near a second (bench/approvals.py); and a deferred read-then-write transaction under
    WAL fails at once with "database is locked" when another writer committed in between."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        # A read sees one snapshot, as every SQLite transaction does: under PostgreSQL's READ
        # COMMITTED each statement sees its own, so a read of a leaf, then of the pending leaves,
        # missed one that the sequencer moved between the two (a replayed search answered 404).
        # Writes stay READ COMMITTED: a statement that waited for a row lock reads the row as committed.
        self._read_sessions = self._sessions if engine.dialect.name == "sqlite" else sessionmaker(
            engine.execution_options(isolation_level="REPEATABLE READ"), expire_on_commit=False
        )
        self._writers = SqliteWriters(sqlite_file(engine.url)) if engine.dialect.name == "sqlite" else None
        # A file's writers commit in groups; PostgreSQL groups its own WAL flushes, and an in-memory
        # database has a connection per thread, which a group could not share.
        self._group = GroupCommit(engine, self._writers) if self._writers is not None and self._writers.on_file else None
        self.doorbell = Doorbell(engine)  # rung after a commit that wrote a pending leaf (wakeup.py)
        self.curves = curves.Known()  # the curves this process saw committed: not written again (curves.py)

    @classmethod
    def connect(cls, url: str) -> Database:
        return cls(make_engine(url))

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads, on one snapshot; whatever it holds is rolled back on exit, never committed."""
        with self._read_sessions() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction that holds the write lock from its first statement; commits on exit
        (SQLite: in a savepoint of the group's transaction, durable when this returns); then, if
        it wrote a pending leaf, rings the log's sequencer."""
        if self._group is not None:
            with self._group.session(self._sessions) as session:
                session.info[curves.KNOWN] = self.curves
                yield session
        else:
            # The session opens and closes (its connection back to the pool) outside the writers' queue.
            with self._sessions() as session, self._writers if self._writers is not None else nullcontext():
                session.info[curves.KNOWN] = self.curves
                session.connection(execution_options={_IMMEDIATE: True})
                try:
                    yield session
                    session.commit()
                except BaseException:
                    session.rollback()
                    raise
        curves.committed(session)  # durable now (a group's COMMIT included): its new curves are known
        if _leaf_committed():
            self.doorbell.ring()

    def dispose(self) -> None:
        if self._group is not None:
            self._group.close()
        self.engine.dispose()  # the doorbell closes with it


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url)
    return config


def migrate(url: str) -> None:
    """Upgrade to head, one process at a time: two that start at once on a fresh database (`serve`
    while `keys create` runs) would both find it unversioned and both create its tables."""
    with _migration_lock(url):
        try:
            command.upgrade(alembic_config(url), "head")
        except CommandError as error:
            if "Can't locate revision" not in str(error):
                raise
            # A database a newer dpledger migrated: its revision is none of ours. Said in one line, not
            # Alembic's traceback, and nothing is written.
            raise UnknownRevision(f"the database (DATABASE_URL) is at a revision this dpledger does not have "
                                  f"({str(error).rsplit(' ', 1)[-1]}): a newer dpledger migrated it; run that "
                                  "version, or point DATABASE_URL at another database") from None


class UnknownRevision(RuntimeError):
    """The database's schema revision is not one of this version's migrations."""


# PostgreSQL: the advisory lock every dpledger migration takes (any fixed 64-bit number; "dpledger").
_MIGRATION_LOCK_KEY = int.from_bytes(b"dpledger", "big") >> 1


@contextmanager
def _migration_lock(url: str) -> Iterator[None]:
    """SQLite: an exclusive flock on a file beside the database; PostgreSQL: a session advisory lock
    held on a connection of its own; an in-memory database has a single migrator."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = sqlite_file(parsed)
        if database is None:
            yield
            return
        with open(f"{database}.migrate-lock", "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    elif backend == "postgresql":
        engine = create_engine(url, poolclass=NullPool)
        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
                try:
                    yield
                finally:
                    connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        finally:
            engine.dispose()
    else:
        yield
