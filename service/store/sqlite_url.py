"""Which database URLs name a SQLite file: the one rule for every place that locks, wakes or guards
beside that file (an in-memory database has none, and lives in one connection)."""

from __future__ import annotations

from sqlalchemy import URL, make_url


def sqlite_file(url: str | URL) -> str | None:
    """The file of a SQLite URL as the URL names it; None for an in-memory database (`sqlite://`,
    `:memory:`, `file::memory:…`, `mode=memory`) or another backend."""
    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:" \
            or database.startswith("file::memory:") or parsed.query.get("mode") == "memory" \
            or "mode=memory" in database:
        return None
    return database
