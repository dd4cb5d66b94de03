"""Dependencies: the session factory, and the caller's principal from `Authorization: Bearer …`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from dpledger.service.ledger import keys
from dpledger.service.ledger.models import Role
from dpledger.wire.schemas import MAX_ID

_bearer = HTTPBearer(auto_error=False, description="an API key: admin, silo, auditor or coordinator")


def session_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.session_factory  # Starlette's state is untyped; app.py stores it
    return factory


FactoryDep = Annotated[sessionmaker[Session], Depends(session_factory)]


@dataclass(frozen=True)
class Principal:
    key_id: int
    role: Role
    silo_id: int | None

    def require(self, *roles: Role) -> None:
        if self.role not in roles:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"role '{self.role.value}' may not do this")

    def require_silo(self, silo_id: int, *, also: tuple[Role, ...] = ()) -> None:
        """That silo's own key, or one of the roles in `also` (which see every silo)."""
        if self.role in also:
            return
        if self.role is Role.silo and self.silo_id == silo_id:
            return
        if self.role is Role.silo:
            # Its own silo id is no secret to the key's holder, and it turns a typo'd id into a clear message.
            message = f"a silo key may act only on its own silo: this key is silo {self.silo_id}'s, not silo {silo_id}'s"
            raise HTTPException(status.HTTP_403_FORBIDDEN, message)
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"role '{self.role.value}' may not do this")


def principal(
    request: Request, factory: FactoryDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing API key", headers={"WWW-Authenticate": "Bearer"})
    with factory() as session:
        key = keys.authenticate(session, credentials.credentials)
    if key is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "unknown or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    caller = Principal(key_id=key.id, role=Role(key.role), silo_id=key.silo_id)
    request.state.principal = caller  # for the access log (service/api/metrics.py); never the key itself
    return caller


PrincipalDep = Annotated[Principal, Depends(principal)]
# Every id in a path: bounded like the columns it names (see schemas.MAX_ID).
IdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
READERS = (Role.admin, Role.auditor)
