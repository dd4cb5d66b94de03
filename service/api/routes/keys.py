from __future__ import annotations

from fastapi import APIRouter, Response, status

from dpledger.service.api.deps import DbDep, IdPath, PrincipalDep
from dpledger.service.ledger import keys
from dpledger.service.store.models import Role
from dpledger.wire.schemas import KeyCreated, KeyCreateRequest, KeyInfo

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=KeyCreated, name="create_key")
def create_key(body: KeyCreateRequest, caller: PrincipalDep, db: DbDep) -> KeyCreated:
    caller.require(Role.admin)
    key, raw = keys.issue(db, role=body.role, silo_id=body.silo_id)
    return KeyCreated(key_id=key.id, api_key=raw)


@router.get("/me", response_model=KeyInfo, name="who_am_i")
def who_am_i(caller: PrincipalDep) -> KeyInfo:
    """The calling key's id, role and silo: lets a worker check each silo's key before round 0."""
    return KeyInfo(key_id=caller.key_id, role=caller.role, silo_id=caller.silo_id)


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT, name="revoke_key")
def revoke_key(key_id: IdPath, caller: PrincipalDep, db: DbDep) -> Response:
    caller.require(Role.admin)
    keys.revoke(db, key_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
