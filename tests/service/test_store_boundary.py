"""SQL lives in the store: no module of the service outside `service/store/` builds or runs a statement,
or branches on the database (issue 43). Static, over the syntax tree, so a lazy import or a statement
built inside a function is found too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service"
STORE = SERVICE / "store"
# What of SQLAlchemy a domain module may name: the session it is handed (and the ORM's bookkeeping of
# what the store wrote), and the errors a write raises.
ALLOWED_MODULES = ("sqlalchemy.orm", "sqlalchemy.exc")
DRIVERS = ("sqlite3", "psycopg", "psycopg2")
# Calls that run SQL or read the connection a statement would run on.
SQL_ATTRIBUTES = {"execute", "scalars", "scalar", "connection", "dialect", "with_for_update", "get_bind"}
DATABASES = {"sqlite", "postgresql"}


def _is(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def violations(path: Path) -> list[str]:
    found: list[str] = []
    where = path.relative_to(ROOT) if ROOT in path.parents else path.name
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            modules = [node.module]
        for module in modules:
            if (_is(module, "sqlalchemy") and not any(_is(module, ok) for ok in ALLOWED_MODULES)) or any(
                    _is(module, driver) for driver in DRIVERS):
                found.append(f"{where}:{node.lineno} imports {module}")
        if isinstance(node, ast.Attribute) and node.attr in SQL_ATTRIBUTES:
            found.append(f"{where}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.Compare):
            names = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if names & DATABASES:
                found.append(f"{where}:{node.lineno} compares with a database's name")
    return found


def test_no_sql_and_no_database_branch_outside_the_store() -> None:
    found = [v for path in sorted(SERVICE.rglob("*.py")) if STORE not in path.parents for v in violations(path)]
    assert found == []


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    # The rule itself can fail: a module like the ledger's before the store.
    probe = tmp_path / "charges.py"
    probe.write_text(
        "from sqlalchemy import select\nimport sqlite3\n"
        "def f(session, silo):\n"
        "    if session.connection().dialect.name == 'postgresql':\n"
        "        return session.scalars(select(silo).with_for_update())\n"
    )
    kinds = sorted({v.split(" ", 1)[1] for v in violations(probe)})
    assert kinds == [".connection", ".dialect", ".scalars", ".with_for_update", "compares with a database's name",
                     "imports sqlalchemy", "imports sqlite3"]
