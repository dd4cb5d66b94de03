"""A SQLite ledger's file: one server holds it, and removed or replaced under that server, it is noticed.

SQLite keeps writing to the file it opened even after the path names another file or none: creates,
`list` and `verify` answered ok on a deleted ledger, and the next start found an empty one with no
admin key. The file's identity (device and inode) is taken when the app is built; while the path
still names that file, requests go on as before. Once it does not, /healthz and every ledger request
answer 503 with one line, and nothing more is written to a file no one will find again. The docs,
the OpenAPI document and /metrics still answer: they hold no ledger data.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from typing import IO

from starlette.types import ASGIApp, Receive, Scope, Send

from dpledger.service.store.sqlite_url import sqlite_file

log = logging.getLogger("dpledger.ledger")

# What the guard refuses once the file is gone: the health check and everything that reads or writes the ledger.
GUARDED_PREFIXES = ("/healthz", "/v1/", "/dashboard")


def ledger_path(url: str) -> str | None:
    """The absolute path of a SQLite ledger's file; None for an in-memory database, another backend,
    or a URI filename (`file:…`, a form this service does not write)."""
    database = sqlite_file(url)
    if database is None or database.startswith("file:"):
        return None
    return os.path.abspath(database)


class LedgerInUse(RuntimeError):
    """Another server holds this SQLite ledger: said in one line, and this one does not start."""


_held: dict[str, IO[str]] = {}  # the lock files this process holds, open for as long as it lives


def hold_ledger(database_url: str) -> None:
    """One server per SQLite ledger: an exclusive flock on `<database>.server-lock`, held until this
    process ends (the kernel drops it when the process dies, however it dies). A second server on the
    same file would sign with a key of its own (development) or interleave a second sequencer: an
    auditor then reads "the ledger's signing key changed". Workers of one server are its children and
    share its lock; PostgreSQL ledgers serve from several hosts by design and take none."""
    path = ledger_path(database_url)
    if path is None or path in _held:
        return
    lock_path = f"{path}.server-lock"
    lock = open(lock_path, "a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise LedgerInUse(f"another dpledger server (pid {holder or 'unknown'}) serves {path} (its lock: {lock_path}); "
                          "one server per SQLite ledger: stop it first, or give that one more --workers") from None
    try:
        _no_workers_left(path)
    except LedgerInUse:
        lock.close()
        raise
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _held[path] = lock


def _no_workers_left(path: str) -> None:
    """Workers outlive a supervisor killed by SIGKILL and go on serving the file (uvicorn's workers are
    not told that their parent died): each holds a shared lock on `<database>.workers-lock` (join_ledger),
    so a server that finds it held does not start beside them."""
    workers_path = f"{path}.workers-lock"
    with open(workers_path, "a") as workers:
        try:
            fcntl.flock(workers.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LedgerInUse(f"worker processes of an earlier dpledger server still serve {path} (its supervisor "
                              f"ended, they did not): stop them first (`fuser {workers_path}` names them)") from None
        fcntl.flock(workers.fileno(), fcntl.LOCK_UN)


_joined: dict[str, IO[str]] = {}


def join_ledger(database_url: str) -> None:
    """A serving process's shared lock on its SQLite ledger's `<database>.workers-lock`, for as long as it
    lives: the server that holds the ledger's lock (hold_ledger) started it."""
    path = ledger_path(database_url)
    if path is None or path in _joined:
        return
    workers = open(f"{path}.workers-lock", "a")
    fcntl.flock(workers.fileno(), fcntl.LOCK_SH)  # waits only while a starting server checks for workers left
    _joined[path] = workers


@dataclass(frozen=True)
class FileWatch:
    path: str
    device: int
    inode: int

    @classmethod
    def of(cls, path: str) -> FileWatch:
        found = os.stat(path)
        return cls(path, found.st_dev, found.st_ino)

    def problem(self) -> str | None:
        """Why the ledger can no longer be trusted to the file at `path`, or None while it is the same file."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return (f"the ledger's database file {self.path} was removed while this server ran: nothing it writes "
                    "would be found again; restore the file (or a backup) and restart the server")
        except OSError as error:
            return f"the ledger's database file {self.path} cannot be read: {error.strerror}"
        if (now.st_dev, now.st_ino) != (self.device, self.inode):
            return (f"the ledger's database file {self.path} was replaced while this server ran (another file, inode "
                    f"{now.st_ino}, now has its name): restart the server to serve the file now there")
        return None


class FileWatchMiddleware:
    """503 with one line for /healthz and the ledger's routes once the file is not the one opened."""

    def __init__(self, app: ASGIApp, watch: FileWatch) -> None:
        self.app = app
        self.watch = watch
        self._said = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIXES):
            problem = self.watch.problem()  # one stat(2): a few microseconds beside a request's milliseconds
            if problem is not None:
                if not self._said:
                    log.error(problem)
                    self._said = True
                body = json.dumps({"detail": problem}).encode()
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
