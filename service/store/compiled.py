"""The approval's writes, run on the driver's cursor: each fixed statement compiled once per database
and set of columns, its parameters bound by the columns' own types (SQLAlchemy's bind processors: a
datetime or an enum is written exactly as SQLAlchemy writes it), its errors raised as SQLAlchemy's.

Why not `Connection.execute`: it spends ~30–45 µs of Python a statement around the driver's call
(measured on a small INSERT … RETURNING: 38–50 µs through it, 5–8 µs on the cursor), and an approval
runs up to five writes whose rows nobody reads back; on the cursor an approval costs 11% fewer
instructions in process (docs/benchmarks.md).

What is kept: the same SQL text SQLAlchemy would send, the same bound values, the connection's
transaction (the cursor is the session's own connection's), and its `before_cursor_execute` /
`after_cursor_execute` listeners (the statement-count tests listen there). Only writes with every
parameter given: a statement with a bind the caller did not name (a column's Python-side default) is
refused at its compile, not written without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement


@dataclass(frozen=True)
class Compiled:
    """One statement as the driver takes it: its SQL, and for each parameter in the driver's order
    (positional drivers) or by name, the type's processor (None: the value goes as it is)."""

    sql: str
    names: tuple[str, ...]
    processors: tuple[Callable[[Any], Any] | None, ...]
    positional: bool
    returns_rows: bool

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
    return Compiled(str(form), names, processors, bool(form.positional), bool(form.returning))


def run(session: Session, statement: ClauseElement, values: dict[str, Any]) -> Any:
    """Runs `statement` with `values` in the session's transaction; the first column of its first row
    where it returns rows (an INSERT … RETURNING id), else None."""
    connection = session.connection()
    return _run(connection, compiled(statement, connection.dialect, frozenset(values)), values)


def _run(connection: Connection, form: Compiled, values: dict[str, Any]) -> Any:
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
        if not form.returns_rows:
            return None
        row = cursor.fetchone()
        return None if row is None else row[0]
    finally:
        cursor.close()
