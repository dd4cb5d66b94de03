"""The transparency log's sequencer: one per database, elected, restartable, in the serving processes.

Every serving process starts one (api/app.py); one of them leads, the others stand by. Leading is a
lock whose holder the operating system or the database drops when the holder dies, so a killed
leader's successor takes over without anyone cleaning up (store/leadership.py: a session advisory
lock on PostgreSQL, an `flock` beside the database on SQLite; a standby takes over within
`leadership.RETRY_S`, or at once on PostgreSQL). Safety does not rest on the election:
`transparency.sequence` locks the log's state row before it reads the pending leaves, so two
sequencers started by hand take turns and never give one index twice.

The leader sleeps until an approval's commit rings it (store/wakeup.py: in-process, or across
processes by a FIFO on SQLite and LISTEN/NOTIFY on PostgreSQL), lets `interval` (100 ms) pass so that the leaves
approved meanwhile share the batch, and on, up to GATHER_TIMES × `interval` (GATHER_MAX_S in all), while fewer than
GATHER_LEAVES rings of its own process came: a batch's fixed cost (a read, a Merkle update, a
signed tree head, a commit) was most of what sequencing cost an approval at a federation's few a
second, one leaf a batch. It sequences them in batches of up to `transparency.BATCH`, again at once
while batches come back full. It looks at least every FALLBACK_S even if no ring
came, so a lost ring delays a leaf, never breaks its promise (`transparency.MERGE_DELAY_MS`). What a
crash leaves pending, between an approval's commit and its batch or in the middle of a batch (rolled
back whole), is sequenced by the next leader at its start: nothing approved goes missing from the log.

This module holds that loop, its thread and its timing; the lock is store/leadership.py's, the
statements store/log.py's and transparency.py's.
"""

from __future__ import annotations

import logging
import threading
import time

from dpledger.service.ledger import transparency
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.store.db import Database
from dpledger.service.store.leadership import RETRY_S, Leadership, has_sequencer, when_disposed
from dpledger.service.store.log import any_pending
from dpledger.service.store.wakeup import LINGER_S, Wakeups, _Fifo, _Notifications, fifo_path
from dpledger.wire.receipts import SignedTreeHead

log = logging.getLogger("dpledger.sequencer")

INTERVAL_S = 0.1  # after a ring, how long the leaves approved meanwhile gather before the batch
# The longest a leader sleeps without a ring: a lost ring delays a leaf this much, well inside
# transparency.MERGE_DELAY_MS (60 s); at rest it costs one read of an empty table per period.
FALLBACK_S = 10.0
# After a ring and `interval`, the leader waits on, to GATHER_TIMES × `interval` in all, while fewer
# than GATHER_LEAVES approvals of its own process rang (at full rate they ring within the interval:
# its batches are as before). At 5 approvals a second, a batch of ~5 leaves, not 1: an approval's
# server CPU on PostgreSQL 6.88 → 5.29 ms (docs/benchmarks.md); a receipt's leaf is in the log
# within ~1 s instead of ~0.1 s, far inside its promise (transparency.MERGE_DELAY_MS).
GATHER_TIMES = 10
GATHER_LEAVES = 16
GATHER_MAX_S = 1.0  # never longer in all, whatever the interval: a leaf's wait stays far inside its promise


class Sequencer:
    def __init__(self, db: Database, signer: TreeHeadSigner, *, interval: float = INTERVAL_S,
                 fallback: float = FALLBACK_S) -> None:
        self._db = db
        self._signer = signer
        self._interval = interval
        # After a ring and the interval, how much longer the leader may gather (module comment).
        self._gathering_s = max(0.0, min((GATHER_TIMES - 1) * interval, GATHER_MAX_S - interval))
        self._fallback = max(fallback, interval)  # a longer interval is asked for (tests): it holds too
        self._stop = threading.Event()
        self._leadership = Leadership(db)
        self._wakeups: Wakeups | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one batch at a time in this process (the thread, or `run_once`)
        self._busy = False  # the last batch sequenced leaves

    @property
    def leading(self) -> bool:
        return self._leadership.held

    def start(self) -> None:
        if (self._thread is not None and self._thread.is_alive()) or not has_sequencer(self._db):
            return
        if self._thread is None:
            # Stopped (its lock released) when the app's engine is disposed: the database is going away.
            when_disposed(self._db, self.stop)
        self._stop.clear()
        self._wakeups = Wakeups()
        self._thread = threading.Thread(target=self._run, args=(self._wakeups,), name="dpledger-sequencer", daemon=True)
        self._thread.start()

    def signal_stop(self) -> None:
        """Asks the thread to end after its current batch, without waiting (safe from a finalizer)."""
        self._stop.set()
        wakeups = self._wakeups
        if wakeups is not None:
            wakeups.interrupt()

    def stop(self, timeout: float = 5.0) -> None:
        self.signal_stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            deadline = time.monotonic() + timeout
            while thread.is_alive() and time.monotonic() < deadline:
                self._leadership.interrupt()  # again, should the cancel have come before the wait began
                thread.join(0.05)
        self._leadership.release()

    def run_once(self) -> int:
        """One batch, if this process leads; returns the leaves sequenced."""
        with self._lock:
            if not self._leadership.held or not self._leadership.still_held():
                return 0
            if not self._busy:  # while batches keep coming, the next is written at once: no read first
                with self._db.read() as session:
                    if not any_pending(session):
                        return 0  # the common idle case: no write lock taken
            with self._db.write() as session:
                done = transparency.sequence(session, self._sign)
            self._busy = done > 0
            return done

    def _sign(self, size: int, root: str) -> SignedTreeHead:
        return self._signer.sign(tree_size=size, root_hash=root)

    def _lead(self, wakeups: Wakeups) -> bool:
        """Waits a while to lead; once this process leads, the commits ring it here."""
        if not self._leadership.acquire(self._stop):
            return False
        connection = self._leadership.dbapi_connection
        path = fifo_path(self._db.engine)
        wakeups.listen(_Notifications(connection, wakeups.heard_remote) if connection is not None
                       else _Fifo(path) if path is not None else None)
        self._db.doorbell.local = wakeups
        return True

    def _follow(self, wakeups: Wakeups) -> None:
        if self._db.doorbell.local is wakeups:
            self._db.doorbell.local = None
        wakeups.stop_listening()
        self._leadership.release()

    def _run(self, wakeups: Wakeups) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if not self._leadership.held:
                        self._follow(wakeups)
                        if not self._lead(wakeups):
                            continue
                    started = time.monotonic()
                    wakeups.batch_begins()
                    done = self.run_once()  # at once when it takes the lead: what a crash left pending
                    if done >= transparency.BATCH:
                        continue  # a backlog: the next batch at once
                    if started - wakeups.remote_at < LINGER_S:
                        # Another process rang lately, and rings at most every RING_EVERY_S: look
                        # again until a look began LINGER_S after its last ring (store/wakeup.py).
                        self._stop.wait(self._interval)
                    elif wakeups.wait(self._fallback) and not self._stop.is_set():
                        # The leaves approved meanwhile join the batch.
                        if not self._stop.wait(self._interval):
                            wakeups.gather(self._gathering_s, GATHER_LEAVES)
                except Exception:
                    log.warning("sequencing failed; retrying in %.0f s", RETRY_S, exc_info=True)
                    self._follow(wakeups)
                    self._stop.wait(RETRY_S)
        finally:
            self._follow(wakeups)
            wakeups.close()
