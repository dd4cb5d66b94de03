"""One rule says which database URLs name a SQLite file (service/store/sqlite_url.py): the writers'
flock, the migration lock, the wake-up FIFO, the sequencer and the deleted-file guard all follow it."""

from __future__ import annotations

import os

import pytest

from dpledger.service.api.ledger_file import ledger_path
from dpledger.service.store.db import SqliteWriters, make_engine
from dpledger.service.store.sqlite_url import sqlite_file

IN_MEMORY = ["sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:",
             "sqlite:///file:ledger?mode=memory&cache=shared&uri=true"]


@pytest.mark.parametrize("url", [*IN_MEMORY, "postgresql+psycopg://postgres@127.0.0.1:5432/test"])
def test_no_file_in_memory_or_on_another_backend(url: str) -> None:
    assert sqlite_file(url) is None
    assert ledger_path(url) is None


@pytest.mark.parametrize("url", IN_MEMORY)
def test_an_in_memory_ledger_takes_no_lock_file_and_no_file_pool_sizes(url: str) -> None:
    engine = make_engine(url)  # pool sizes on an in-memory engine's SingletonThreadPool would raise
    try:
        assert not SqliteWriters(sqlite_file(engine.url)).on_file
    finally:
        engine.dispose()


def test_a_file_is_named_as_the_url_names_it_and_guarded_at_its_absolute_path(tmp_path) -> None:
    assert sqlite_file("sqlite:///ledger.db") == "ledger.db"
    assert sqlite_file(f"sqlite:///{tmp_path}/ledger.db") == f"{tmp_path}/ledger.db"
    assert ledger_path("sqlite:///ledger.db") == os.path.abspath("ledger.db")
    # A URI filename is a file (locks beside it) but not a form the deleted-file guard watches.
    assert sqlite_file("sqlite:///file:ledger.db?uri=true") == "file:ledger.db"
    assert ledger_path("sqlite:///file:ledger.db?uri=true") is None
    engine = make_engine(f"sqlite:///{tmp_path}/ledger.db")
    try:
        assert SqliteWriters(sqlite_file(engine.url)).on_file
        assert engine.pool.size() == 20  # type: ignore[attr-defined]  # a QueuePool's
    finally:
        engine.dispose()
