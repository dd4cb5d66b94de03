"""How each database's driver says that a write failed for want of disk space."""

from __future__ import annotations

import errno
import sqlite3

# PostgreSQL's SQLSTATE for "disk full" (class 53, insufficient resources).
_PG_DISK_FULL = "53100"


def disk_full(error: BaseException | None) -> bool:
    """Whether a failed write failed for want of disk space, however the database's driver said it:
    SQLite's SQLITE_FULL ("database or disk is full"), an OSError ENOSPC, PostgreSQL's 53100. Follows
    the error's causes, contexts and SQLAlchemy's `orig`."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if isinstance(error, sqlite3.Error) and (
            getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "database or disk is full" in str(error)
        ):
            return True
        if getattr(error, "sqlstate", None) == _PG_DISK_FULL:
            return True
        error = error.__cause__ or error.__context__ or getattr(error, "orig", None)
    return False
