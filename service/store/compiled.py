"""The approval's fixed statements, run on the driver's cursor: each compiled once per database and
set of columns, its parameters bound by the columns' own types (SQLAlchemy's bind processors: a
datetime or an enum is written exactly as SQLAlchemy writes it), its rows read back by their own
(its result processors: an enum or a datetime reads as SQLAlchemy reads it), its errors raised as
SQLAlchemy's.

Why not `Connection.execute`: it spends ~30–45 µs of Python a statement around the driver's call
(measured on a small INSERT … RETURNING: 38–50 µs through it, 5–8 µs on the cursor), and an approval
runs up to five writes whose rows nobody reads back; on the cursor an approval costs 11% fewer
instructions in process (docs/benchmarks.md).

The approval's one read that is not a lock (the entries that cover the silo's record, store/reserving.py)
runs here too (`rows`): a result read through `Connection.execute` asks the driver to describe its
26 columns at every execution (psycopg builds an object a column) and builds SQLAlchemy's rows,
where the columns' processors here are chosen once, from the first execution's description, and the
rows come back as named tuples: the read cost 150–160 µs of CPU through it and 86 on the cursor on
PostgreSQL, 45 and 26 on SQLite (in process, 3 entries).

What is kept: the same SQL text SQLAlchemy would send, the same bound values, the connection's
transaction (the cursor is the session's own connection's), and its `before_cursor_execute` /
`after_cursor_execute` listeners (the statement-count tests listen there). Only writes with every
parameter given: a statement with a bind the caller did not name (a column's Python-side default) is
refused at its compile, not written without it.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement


@dataclass(frozen=True, eq=False)  # one per statement, database and keys (compiled's cache): equal only to itself
class Compiled:
    """One statement as the driver takes it: its SQL, and for each parameter in the driver's order
    (positional drivers) or by name, the type's processor (None: the value goes as it is); a SELECT's
    columns (name, type), in the order its rows hold them."""

    sql: str
    names: tuple[str, ...]
    processors: tuple[Callable[[Any], Any] | None, ...]
    positional: bool
    returns_rows: bool
    columns: tuple[tuple[str, Any], ...] = ()

    def parameters(self, values: dict[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        bound = [value if process is None else process(value)
                 for value, process in zip((values[name] for name in self.names), self.processors, strict=True)]
        return tuple(bound) if self.positional else dict(zip(self.names, bound, strict=True))


@functools.lru_cache(maxsize=256)  # a few statements per engine; tests make many engines
def compiled(statement: ClauseElement, dialect: Dialect, keys: frozenset[str]) -> Compiled:
    """`statement` compiled for `dialect` with the columns `keys` (an INSERT's or UPDATE's column list
    is the parameters it is given, as SQLAlchemy compiles it at execution). One per statement,
    database and set of keys: the approval's few."""
    form = cast(SQLCompiler, statement.compile(dialect=dialect, column_keys=sorted(keys)))
    names = tuple(form.positiontup or ()) if form.positional else tuple(form.binds)
    missing = [name for name in names if name not in keys]
    if missing:
        raise ValueError(f"{missing} would be bound by SQLAlchemy's defaults: run this statement through execute()")
    processors = tuple(form.binds[name].type.dialect_impl(dialect).bind_processor(dialect) for name in names)
    selected = getattr(statement, "selected_columns", None)  # a SELECT's (a compound's: its first SELECT's)
    columns = () if selected is None else tuple((column.key, column.type) for column in selected)
    return Compiled(str(form), names, processors, bool(form.positional), bool(form.returning) or bool(columns), columns)


@dataclass(frozen=True)
class _Reader:
    """How a SELECT's rows are read: a named tuple of its columns, and the columns that a processor turns
    into what SQLAlchemy would return (an enum, a datetime from SQLite's text), each with it."""

    row: Callable[..., Any]
    processed: tuple[tuple[int, Callable[[Any], Any]], ...]

    def __call__(self, raw: Sequence[Any]) -> Any:
        if not self.processed:
            return self.row(*raw)
        values = list(raw)
        for index, process in self.processed:
            values[index] = process(values[index])
        return self.row(*values)


# Each SELECT's reader, chosen at its first execution (a processor may depend on the type the driver
# reports, psycopg's numeric ones do): a few statements; emptied at the size compiled's cache keeps.
_READERS: dict[Compiled, _Reader] = {}


def _reader(form: Compiled, dialect: Dialect, description: Sequence[Sequence[Any]]) -> _Reader:
    processed = []
    for index, ((_, type_), described) in enumerate(zip(form.columns, description, strict=True)):
        process = type_.dialect_impl(dialect).result_processor(dialect, described[1])
        if process is not None:
            processed.append((index, process))
    if len(_READERS) >= 256:
        _READERS.clear()
    row = namedtuple("Row", [name for name, _ in form.columns])  # type: ignore[misc]  # its fields are known at run time only
    reader = _READERS[form] = _Reader(row, tuple(processed))
    return reader


def run(session: Session, statement: ClauseElement, values: dict[str, Any]) -> Any:
    """Runs `statement` with `values` in the session's transaction; the first column of its first row
    where it returns rows (an INSERT … RETURNING id), else None."""
    connection = session.connection()
    return _run(connection, compiled(statement, connection.dialect, frozenset(values)), values, every=False)


def rows(session: Session, statement: ClauseElement, values: dict[str, Any]) -> list[Any]:
    """The rows of a SELECT `statement` with `values`, in the session's transaction, as named tuples of
    its columns (by their keys, as a `Row` reads them), each value as SQLAlchemy returns it."""
    connection = session.connection()
    form = compiled(statement, connection.dialect, frozenset(values))
    assert form.columns, "rows() reads a SELECT"
    return cast(list[Any], _run(connection, form, values, every=True))


def _run(connection: Connection, form: Compiled, values: dict[str, Any], *, every: bool) -> Any:
    parameters = form.parameters(values)
    driver = connection.connection.dbapi_connection
    assert driver is not None, "the session's connection is open"
    cursor = driver.cursor()
    listened = connection._has_events or connection.engine._has_events  # the same test execute() makes
    try:
        if listened:
            connection.dispatch.before_cursor_execute(connection, cursor, form.sql, parameters, None, False)
        try:
            cursor.execute(form.sql, parameters)
        except connection.dialect.loaded_dbapi.Error as error:
            invalidated = connection.dialect.is_disconnect(error, driver, cursor)
            if invalidated:
                connection.invalidate(error)
            raise exc.DBAPIError.instance(form.sql, parameters, error, connection.dialect.loaded_dbapi.Error,
                                          connection_invalidated=invalidated, dialect=connection.dialect) from error
        if listened:
            connection.dispatch.after_cursor_execute(connection, cursor, form.sql, parameters, None, False)
        if every:
            reader = _READERS.get(form) or _reader(form, connection.dialect, cursor.description)
            return [reader(row) for row in cursor.fetchall()]
        if not form.returns_rows:
            return None
        row = cursor.fetchone()
        return None if row is None else row[0]
    finally:
        cursor.close()
