"""API keys: random bearer tokens, stored only as their SHA-256 (a 256-bit random secret needs no
slow hash: there is nothing to brute-force)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dpledger.service.ledger.errors import InvalidRequest, NotFound, Unauthorized
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
    key = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(raw))).one_or_none()
    if key is None or key.revoked_at is not None:
        return None
    return key


def revoke(db: Database, key_id: int) -> None:
    with db.write() as session:
        key = session.get(ApiKey, key_id)
        if key is None or key.revoked_at is not None:
            raise NotFound(f"key {key_id} not found")
        key.revoked_at = datetime.now(UTC)


_KEYS = ApiKey.__table__
_REVOKED_AT = select(_KEYS.c.revoked_at).where(_KEYS.c.id == bindparam("key_id")).with_for_update(read=True)
# The key `key_id` if it is live (a reservation reads it in its lock's statement, charges._lock).
LIVE = select(_KEYS.c.id).where(_KEYS.c.id == bindparam("key_id"), _KEYS.c.revoked_at.is_(None))


def require_live(session: Session, key_id: int | None) -> None:
    """Inside a write transaction: the caller's key is still live. A key revoked while its request
    was in flight writes nothing. On PostgreSQL the row is share-locked, so a revocation waits for
    this transaction (which then happened before it); SQLite's write lock already orders them."""
    if key_id is None:
        return
    # Core, the one row: every approval makes this read, and needs no key object from it.
    found = session.connection().execute(_REVOKED_AT, {"key_id": key_id}).one_or_none()
    if found is None or found.revoked_at is not None:
        raise Unauthorized("unknown or revoked API key")


def ensure_admin_key(db: Database, raw: str) -> None:
    """Registers the bootstrap admin key (DPLEDGER_ADMIN_KEY) once; several workers may race here."""
    # SQLite: a deferred read-then-write transaction fails at once with "database is locked" when
    # another worker wrote first (the busy timeout does not apply), killing that worker at start-up;
    # the write lock up front makes the racers wait and then find the key.
    try:
        with db.write() as session:
            if session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(raw))).one_or_none():
                return
            create_key(session, role=Role.admin, silo_id=None, raw=raw)
    except IntegrityError:
        pass  # PostgreSQL: another worker registered it first
