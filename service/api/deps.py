"""Dependencies: the ledger's database, and the caller's principal from `Authorization: Bearer …`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from dpledger.service.ledger import keys
from dpledger.service.ledger.errors import NotFound
from dpledger.service.store.db import Database
from dpledger.service.store.models import Role
from dpledger.wire.schemas import MAX_ID

READERS = (Role.admin, Role.auditor)  # they see every silo
BEARER = HTTPBearer(auto_error=False, description="an API key: admin, silo, auditor or coordinator")


async def database(request: Request) -> Database:
    # async: FastAPI runs a sync dependency in the threadpool, a hop per request for one attribute.
    return request.app.state.db  # type: ignore[no-any-return]  # set by create_app


DbDep = Annotated[Database, Depends(database)]


@dataclass(frozen=True)
class Principal:
    key_id: int
    role: Role
    silo_id: int | None

    def require(self, *roles: Role) -> None:
        if self.role not in roles:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"role '{self.role.value}' may not do this")

    def require_silo(self, silo_id: int, *, also: tuple[Role, ...] = ()) -> None:
        """That silo's own key, or one of the roles in `also`, may act. A reader (admin, auditor:
        they see every silo) who may not act gets a 403; anyone else is told the silo does not
        exist, exactly as for an id that names none, since a 403 would tell them which silos exist."""
        if self.role in also or (self.role is Role.silo and self.silo_id == silo_id):
            return
        if self.role in READERS:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"role '{self.role.value}' may not do this")
        raise NotFound(f"silo {silo_id} not found")

    def silo_scope(self, *, also: tuple[Role, ...]) -> int | None:
        """None where the caller acts on every silo (a role in `also`), else the one silo it may act on.
        A role that may act on none gets a scope no silo has (ids start at 1)."""
        if self.role in also:
            return None
        return self.silo_id if self.role is Role.silo and self.silo_id is not None else 0


BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]


def authenticate(request: Request, session: Session, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The caller's principal from its key, read in the caller's session (one indexed query)."""
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing API key", headers={"WWW-Authenticate": "Bearer"})
    key = keys.authenticate(session, credentials.credentials)
    if key is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "unknown or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    caller = Principal(key_id=key.id, role=Role(key.role), silo_id=key.silo_id)
    request.state.principal = caller  # for the access log (service/api/metrics.py); never the key itself
    return caller


def principal(request: Request, db: DbDep, credentials: BearerDep) -> Principal:
    with db.read() as session:
        return authenticate(request, session, credentials)


PrincipalDep = Annotated[Principal, Depends(principal)]
# Every id in a path: bounded like the columns it names (see schemas.MAX_ID).
IdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
