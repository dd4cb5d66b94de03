"""Wake-ups for the log's sequencer, so that its leader sleeps while nothing is approved.

A commit that wrote a pending leaf rings the database's `Doorbell` (`Database.write`, told by
`transparency.pending_leaf` through `db.leaf_written`):
- in the leader's own process, one byte on a socket pair the leader polls (`Wakeups`), and no more
  until the leader has drained it: a busy process rings with a flag test, not a system call;
- from another process, a byte into a FIFO beside a SQLite database (`<db>.sequencer-wake`, held open
  by the leader), or a `NOTIFY` on PostgreSQL, sent after the commit on a connection of the
  doorbell's own and heard by the leader on its advisory lock's connection (`LISTEN`). A process
  rings another at most every RING_EVERY_S; after a ring from elsewhere the leader keeps looking every
  interval for LINGER_S (> RING_EVERY_S), so the leaves whose ring was skipped are found all the same.
A ring can be lost (a leader elected after it, a connection that dropped): that costs latency, never
a leaf; the leader looks at least every `sequencer.FALLBACK_S`, far inside the promised delay.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
import stat
import threading
import time
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import NullPool

from dpledger.service.store.sqlite_url import sqlite_file

log = logging.getLogger("dpledger.sequencer")

CHANNEL = "dpledger_sequencer"  # PostgreSQL's LISTEN/NOTIFY channel of the log's sequencer
RING_EVERY_S = 0.1  # the most often one process rings a leader in another
LINGER_S = 3 * RING_EVERY_S  # how long a leader keeps looking after a ring from another process


class _Fifo:
    """SQLite, the leader's end of `<db>.sequencer-wake`: opened read-write, so that the FIFO never
    reads as closed (POLLHUP) while no other process holds it open for writing."""

    def __init__(self, path: str) -> None:
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            pass
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        if not stat.S_ISFIFO(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OSError(errno.EINVAL, f"{path} is not a FIFO")

    def drain(self) -> bool:
        got = False
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                return got
            got = got or bool(chunk)
            if not chunk:
                return got

    def close(self) -> None:
        os.close(self.fd)


class _Notifications:
    """PostgreSQL, the leader's ear: LISTEN on the connection that holds its advisory lock. A
    notification read while that connection runs a statement (the leader's liveness ping) goes to
    the handler; one that waits in the socket is read by `drain`."""

    def __init__(self, connection: Any, heard: Any) -> None:
        self._connection = connection  # psycopg's, in autocommit
        self._heard = heard
        connection.execute(f"LISTEN {CHANNEL}")
        connection.add_notify_handler(self._handler)
        self.fd = int(connection.fileno())

    def _handler(self, _notify: object) -> None:
        self._heard()

    def drain(self) -> bool:
        """Reads what the socket holds; raises when the connection is gone (its lock with it)."""
        connection = self._connection
        with connection.lock:
            pgconn = connection.pgconn
            pgconn.consume_input()  # raises OperationalError once the server has closed the connection
            got = False
            while pgconn.notifies() is not None:
                got = True
        return got

    def close(self) -> None:
        try:
            self._connection.remove_notify_handler(self._handler)
        except ValueError:
            pass


class Wakeups:
    """The leader's side: one poll over a ring from its own process, from another, and a stop."""

    def __init__(self) -> None:
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._tx.setblocking(False)
        self._rung = False  # a byte is on its way: a busy process rings with this test alone
        # Rings of this process since the leader's last batch began (`gather`), and the count that
        # ends its gathering: an approximate count (a += from many threads), only ever a wait's end.
        self.rings = 0
        self._enough_at = math.inf
        self._enough = threading.Event()
        self._remote: _Fifo | _Notifications | None = None
        self.remote_at = -math.inf  # monotonic time of the last ring heard from another process

    def ring(self) -> None:
        self.rings += 1
        if self.rings >= self._enough_at:
            self._enough.set()
        if self._rung:
            return
        self._rung = True
        self._send()

    def gather(self, seconds: float, leaves: int) -> None:
        """Sleeps while fewer than `leaves` rings came since the last `batch_begins`, up to `seconds`;
        an `interrupt` ends it."""
        self._enough_at = leaves
        try:
            if self.rings < leaves:  # after setting the mark: a ring from now on sets the event
                self._enough.wait(seconds)
        finally:
            self._enough_at = math.inf
            self._enough.clear()

    def batch_begins(self) -> None:
        """The leader reads the pending leaves now: the rings before this are in its batch."""
        self.rings = 0

    def interrupt(self) -> None:
        """Ends a `wait` or a `gather` now (a stop; safe from any thread, and after `close`)."""
        self._enough.set()
        self._send()

    def _send(self) -> None:
        try:
            self._tx.send(b"\0")
        except OSError:  # full (the leader has a byte to wake for already), or closed
            pass

    def listen(self, remote: _Fifo | _Notifications | None) -> None:
        self.stop_listening()
        self._remote = remote

    def stop_listening(self) -> None:
        remote, self._remote = self._remote, None
        if remote is not None:
            try:
                remote.close()
            except OSError:
                log.debug("the sequencer's wake-up channel was closed already")

    def heard_remote(self) -> None:
        self.remote_at = time.monotonic()

    def drain(self) -> bool:
        """Whether anything rang since the last drain; afterwards the next ring sends a byte again."""
        self._rung = False  # before reading: a ring from now on is a byte left for the next wait
        got = False
        while True:
            try:
                got = bool(self._rx.recv(4096)) or got
            except BlockingIOError:
                break
        remote = self._remote
        if remote is not None and remote.drain():
            self.heard_remote()
            got = True
        return got

    def wait(self, timeout: float) -> bool:
        """Sleeps until a ring or `timeout` seconds; whether anything rang."""
        poller = select.poll()  # not select.select: a server's descriptors may be numbered past 1024
        poller.register(self._rx, select.POLLIN)
        remote = self._remote
        if remote is not None:
            poller.register(remote.fd, select.POLLIN)
        if not poller.poll(max(0.0, timeout) * 1000):
            return False
        return self.drain()

    def close(self) -> None:
        self.stop_listening()
        self._rx.close()
        self._tx.close()


def fifo_path(engine: Engine) -> str | None:
    database = sqlite_file(engine.url)
    return None if database is None else f"{database}.sequencer-wake"


class Doorbell:
    """The committing side: `ring()` after a commit that wrote a pending leaf; never raises."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._postgres = engine.dialect.name == "postgresql"
        self._fifo = fifo_path(engine)
        self.local: Wakeups | None = None  # this process's leader, while it leads
        self._last_remote = -math.inf
        self._remote = threading.Lock()  # one remote ring at a time; one that finds it taken is not needed
        self._fd: int | None = None  # SQLite: the FIFO, open for writing
        self._bell_engine: Engine | None = None  # PostgreSQL: NOTIFY on a connection of its own
        self._bell: Connection | None = None
        event.listen(engine, "engine_disposed", lambda _engine: self.close())

    def ring(self) -> None:
        local = self.local
        if local is not None:
            local.ring()
            return
        now = time.monotonic()
        if now - self._last_remote < RING_EVERY_S or not self._remote.acquire(blocking=False):
            return
        try:
            self._last_remote = now
            if self._postgres:
                self._notify()
            elif self._fifo is not None:
                self._write_fifo(self._fifo)
        except Exception:  # the leader finds the leaf by its fallback: an approval never fails for a ring
            log.debug("ringing the sequencer failed", exc_info=True)
        finally:
            self._remote.release()

    def _write_fifo(self, path: str) -> None:
        if self._fd is None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: nobody reads it (no leader now); ENOENT: no leader yet
                return
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                return
            self._fd = fd
        try:
            os.write(self._fd, b"\0")
        except BlockingIOError:  # full: the leader has plenty to wake for
            pass
        except OSError:  # EPIPE: the leader that read it is gone; the next ring opens it again
            os.close(self._fd)
            self._fd = None

    def _notify(self) -> None:
        if self._bell is None:
            if self._bell_engine is None:
                self._bell_engine = create_engine(self._engine.url, poolclass=NullPool)
            self._bell = self._bell_engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            self._bell.exec_driver_sql(f"NOTIFY {CHANNEL}")
        except Exception:
            bell, self._bell = self._bell, None
            bell.invalidate()
            raise

    def close(self) -> None:
        with self._remote:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._bell is not None:
                self._bell.close()
                self._bell = None
            if self._bell_engine is not None:
                self._bell_engine.dispose()
                self._bell_engine = None
