"""SQLite group commit (store/db.py `GroupCommit`): writers that queue behind one another share one
transaction and one COMMIT, each in a savepoint of its own. On a real SQLite file: a writer's error
undoes its own changes only; a writer returns only once its changes are durable; a COMMIT that fails
fails every writer of its group, and none of their changes is in the database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from dpledger.service.store import db as ledger_db
from dpledger.service.store.db import CommitFailed, Database


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    database = Database.connect(f"sqlite:///{tmp_path}/group.db")
    with database.engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (1)")
        # Checked at COMMIT, not at the INSERT: a real way for a group's COMMIT to fail.
        connection.exec_driver_sql(
            "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER NOT NULL UNIQUE "
            "REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
    yield database
    database.dispose()


def children(database: Database) -> list[int]:
    """Read on a connection of its own: what another process would see."""
    other = create_engine(database.engine.url)
    try:
        with other.connect() as connection:
            return [row[0] for row in connection.execute(text("SELECT parent_id FROM child ORDER BY parent_id"))]
    finally:
        other.dispose()


def insert(parent_id: int) -> Callable[[Database], None]:
    def write(database: Database) -> None:
        with database.write() as session:
            session.execute(text("INSERT INTO child (parent_id) VALUES (:p)"), {"p": parent_id})
    return write


def in_one_group(
    database: Database, others: list[Callable[[Database], None]], *, first_fails: bool = False
) -> list[BaseException | None]:
    """A first writer (parent 1's child) holds its turn until every one of `others` is queued behind
    it, so all join its group; returns each one's error (the first writer's first), None if it wrote."""
    group = database._group
    assert group is not None
    release = threading.Event()

    def first(_: Database) -> None:
        with database.write() as session:
            session.execute(text("INSERT INTO child (parent_id) VALUES (1)"))
            release.wait(10)
            if first_fails:
                raise RuntimeError("the first writer's own error")

    writes = [first, *others]
    outcomes: list[BaseException | None] = [None] * len(writes)

    def run(k: int) -> None:
        try:
            writes[k](database)
        except BaseException as error:  # the outcome is what the test reads
            outcomes[k] = error

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(writes))]
    threads[0].start()
    deadline = time.monotonic() + 10
    while group._connection is None and time.monotonic() < deadline:
        time.sleep(0.001)
    for thread in threads[1:]:
        thread.start()
    while group._queued < len(others) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert group._queued == len(others)
    release.set()
    for thread in threads:
        thread.join(10)
    return outcomes


def test_a_group_shares_one_commit_and_a_failing_writer_undoes_only_its_own(database: Database, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with database.engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (2), (3), (4)")
    commits: list[object] = []
    original = ledger_db.GroupCommit._end
    monkeypatch.setattr(ledger_db.GroupCommit, "_end", lambda self, error: commits.append(error) or original(self, error))

    outcomes = in_one_group(database, [insert(2), insert(2), insert(3), insert(4)])

    assert outcomes[0] is None and outcomes[3] is None and outcomes[4] is None
    # Parent 2's two writers race for their place in the group (a busy machine may start the second
    # first): one inserts its child, the other meets UNIQUE, and that undoes its own write only.
    one, other = outcomes[1:3]
    assert (one is None and isinstance(other, IntegrityError)) or (other is None and isinstance(one, IntegrityError)), outcomes
    assert commits == [None]  # five writers, one COMMIT
    assert children(database) == [1, 2, 3, 4]


def test_the_first_writer_of_a_group_undoes_its_own_changes_only(database: Database) -> None:
    with database.engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (2), (3)")

    outcomes = in_one_group(database, [insert(2), insert(3)], first_fails=True)

    assert isinstance(outcomes[0], RuntimeError) and outcomes[1:] == [None, None]
    assert children(database) == [2, 3]


def test_a_writer_returns_only_once_its_changes_are_durable(database: Database) -> None:
    with database.engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES " + ", ".join(f"({i})" for i in range(2, 41)))
    seen: dict[int, list[int]] = {}

    def write_then_look(parent_id: int) -> None:
        insert(parent_id)(database)
        seen[parent_id] = children(database)

    threads = [threading.Thread(target=write_then_look, args=(i,)) for i in range(1, 41)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(seen) == list(range(1, 41))
    assert all(parent_id in visible for parent_id, visible in seen.items())


def test_a_failed_commit_fails_every_writer_of_its_group_and_keeps_none_of_their_changes(database: Database) -> None:
    outcomes = in_one_group(database, [insert(99)])  # parent 99 does not exist: the COMMIT fails

    assert all(isinstance(outcome, CommitFailed) for outcome in outcomes), outcomes
    assert "FOREIGN KEY" in str(outcomes[0])
    assert children(database) == []
    insert(1)(database)  # the next group starts clean
    assert children(database) == [1]


def test_groups_run_on_one_kept_connection_and_a_failed_group_gives_it_up(database: Database) -> None:
    group = database._group
    assert group is not None

    def driver() -> object:
        assert group._kept is not None
        return group._kept.connection.dbapi_connection

    insert(1)(database)
    kept = driver()
    with database.engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (2)")
    insert(2)(database)
    assert driver() is kept and database.engine.pool.checkedout() == 1  # not taken from the pool again
    with pytest.raises(CommitFailed):
        insert(99)(database)  # parent 99 does not exist: the group's COMMIT fails
    assert group._kept is None
    with database.engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (3)")
    insert(3)(database)
    assert driver() is not kept and children(database) == [1, 2, 3]
    kept = driver()
    database.engine.dispose()  # a new pool: every connection from now on is a new one, the kept one too
    with database.engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO parent (id) VALUES (4)")
    insert(4)(database)
    assert driver() is not kept and children(database) == [1, 2, 3, 4]
    database.dispose()
    assert group._kept is None and database.engine.pool.checkedout() == 0
