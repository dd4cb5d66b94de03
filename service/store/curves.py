"""Charges' RDP curves, stored once per ledger: the `curves` table keys each curve's exact text by its
SHA-256, and a charge holds the key (`charges.curve_hash`). A job repeats one (mechanism, q, σ) pair,
so its thousands of charges share one row where each used to store its ~3.3 KB of text.

Nothing that a hash covers moves: the ORM's `Charge.rdp` reads the text through the key, and the entry
hash, the log's leaf, receipts and the served records cover that text exactly as they covered the
column (chain.charge_fields). An edited curve row therefore breaks the entries of every charge that
names it; a row whose text no longer hashes to its key is named as such by the audit (`mismatched`).

An approval writes its curve in the statements it runs anyway: on PostgreSQL an INSERT … ON CONFLICT
DO NOTHING in the charge's own statement (store/postgres.py), on SQLite one more
in-process statement. A curve this process has seen committed (`Known`) is not written again, so the
common path (a pair repeated) runs exactly the statements it ran before. The set only ever saves a
write: a charge naming a curve the table lacks is refused by the foreign key, never stored.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from typing import cast

from sqlalchemy.orm import Session

from dpledger.service.store import postgres, sqlite

# Where a write transaction keeps what it knows of curves (Database.write sets and reads these).
KNOWN = "dpledger.known_curves"  # the process's Known for this database
WRITTEN = "dpledger.written_curves"  # the keys this transaction wrote, known once it commits
# A ledger holds one row per distinct pair; past this many the set starts over (a few MB at most).
KNOWN_AT_MOST = 65_536


def key(text: str) -> str:
    """A curve's key: the SHA-256 of its exact text (the bytes every hash of the ledger covers)."""
    return hashlib.sha256(text.encode()).hexdigest()


def mismatched(key_: str, text: str | None) -> bool:
    """Whether a stored curve row is not what its key names (an edited row), or is missing."""
    return text is None or key(text) != key_


class Known:
    """The keys of curves this process saw committed to its database. Added only after the commit that
    holds them returned (Database.write): a rolled-back write adds nothing."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, key_: object) -> bool:
        return key_ in self._keys

    def add(self, keys: Iterable[str]) -> None:
        with self._lock:
            if len(self._keys) >= KNOWN_AT_MOST:
                self._keys = set()
            self._keys.update(keys)


def reference(session: Session, text: str) -> tuple[str, bool]:
    """The key of the curve `text` and whether this transaction must write its row (not known committed).
    A key to write is noted on the session, to be known once its transaction commits: the caller writes
    the row in this transaction whenever told to (`store`, or the approval's statement)."""
    digest = key(text)
    known = session.info.get(KNOWN)
    if known is not None and digest in known:
        return digest, False
    session.info.setdefault(WRITTEN, set()).add(digest)
    return digest, True


def committed(session: Session) -> None:
    """After the transaction of `session` committed: the curves it wrote are known to this process."""
    known, written = session.info.get(KNOWN), session.info.pop(WRITTEN, None)
    if known is not None and written:
        cast(Known, known).add(written)


# Built once, per database (an approval runs the SQLite one; PostgreSQL's goes in its CTE, store/postgres.py).
INSERT = {"sqlite": sqlite.INSERT_CURVE, "postgresql": postgres.INSERT_CURVE}


def store(session: Session, text: str) -> str:
    """The key of curve `text`, its row written first where this process does not know it stored (one
    statement; an approval on PostgreSQL puts it in its own statement instead, silos.append_entry)."""
    digest, write = reference(session, text)
    if write:
        connection = session.connection()
        connection.execute(INSERT[connection.dialect.name], {"curve_hash": digest, "curve_rdp": text})
    return digest
