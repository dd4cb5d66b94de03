"""Engine and transactions. SQLite: WAL, synchronous=FULL, BEGIN IMMEDIATE for writes.
PostgreSQL: row locks (`SELECT … FOR UPDATE`) taken by the ledger."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
_IMMEDIATE = "dpledger_immediate"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
        _configure_sqlite(engine)
        return engine
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
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
    def _on_begin(connection) -> None:  # type: ignore[no-untyped-def]
        # A deferred transaction that reads, then writes, can fail with SQLITE_BUSY_SNAPSHOT when
        # another writer got in between; IMMEDIATE takes the write lock up front and waits for it.
        immediate = connection.get_execution_options().get(_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def write_transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction that holds SQLite's write lock from its first statement; commits on exit."""
    with factory() as session:
        session.connection(execution_options={_IMMEDIATE: True})
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url)
    return config


def migrate(url: str) -> None:
    command.upgrade(alembic_config(url), "head")
