"""API keys: random bearer tokens, stored only as their SHA-256 (a 256-bit random secret needs no
slow hash: there is nothing to brute-force)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dpledger.service.ledger.errors import InvalidRequest, NotFound, Unauthorized
from dpledger.service.store import records, reserving
from dpledger.service.store.db import Database
from dpledger.service.store.models import ApiKey, Role, Silo

KEY_PREFIX = "dpl_"


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def issue(db: Database, *, role: Role, silo_id: int | None) -> tuple[ApiKey, str]:
    """A new key in its own write transaction, returned with its secret (shown once)."""
    with db.write() as session:
        return create_key(session, role=role, silo_id=silo_id)


def create_key(session: Session, *, role: Role, silo_id: int | None, raw: str | None = None) -> tuple[ApiKey, str]:
    """Adds a key inside the caller's write transaction and returns it with its secret, shown once."""
    if (role is Role.silo) != (silo_id is not None):
        raise InvalidRequest("silo_id", "is required for role 'silo' and not allowed for other roles")
    if silo_id is not None and session.get(Silo, silo_id) is None:
        raise NotFound(f"silo {silo_id} not found")
    raw = raw or new_secret()
    key = ApiKey(key_hash=hash_key(raw), role=role, silo_id=silo_id, created_at=datetime.now(UTC))
    session.add(key)
    session.flush()
    return key, raw


def authenticate(session: Session, raw: str) -> ApiKey | None:
    key = records.key_by_hash(session, hash_key(raw))
    if key is None or key.revoked_at is not None:
        return None
    return key


def revoke(db: Database, key_id: int) -> None:
    with db.write() as session:
        key = session.get(ApiKey, key_id)
        if key is None or key.revoked_at is not None:
            raise NotFound(f"key {key_id} not found")
        key.revoked_at = datetime.now(UTC)


def require_live(session: Session, key_id: int | None) -> None:
    """Inside a write transaction: the caller's key is still live. A key revoked while its request
    was in flight writes nothing. On PostgreSQL the row is share-locked, so a revocation waits for
    this transaction (which then happened before it); SQLite's write lock already orders them."""
    if key_id is None:
        return
    # Core, the one row: every approval makes this read, and needs no key object from it.
    if not reserving.key_live(session, key_id):
        raise Unauthorized("unknown or revoked API key")


def ensure_admin_key(db: Database, raw: str) -> None:
    """Registers the bootstrap admin key (DPLEDGER_ADMIN_KEY) once; several workers may race here."""
    # SQLite: a deferred read-then-write transaction fails at once with "database is locked" when
    # another worker wrote first (the busy timeout does not apply), killing that worker at start-up;
    # the write lock up front makes the racers wait and then find the key.
    try:
        with db.write() as session:
            if records.key_by_hash(session, hash_key(raw)):
                return
            create_key(session, role=Role.admin, silo_id=None, raw=raw)
    except IntegrityError:
        pass  # PostgreSQL: another worker registered it first
