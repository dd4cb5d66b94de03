"""GET /v1/log/checkpoint: the log's current head as a C2SP checkpoint (c2sp.org/tlog-checkpoint), a
signed note that Go's `note.Open`, a witness or any tool of the transparency-log ecosystem reads.

Signed by the key that signs the log's heads (`signer.py`), under the log's origin as key name:
`DPLEDGER_LOG_ORIGIN`, or `dpledger.log/<the first 16 hex digits of the key's SHA-256>`, so that a
new key is a new origin. Ed25519 is deterministic: the same size and root always give the same
note, whichever replica answers. The note's text can never be the bytes of a head or a promise
(those carry a NUL, which a note may not), so one key serves the three without ambiguity.

Readable by the log's readers (admin, auditor, silo), never by the coordinator (the log's size
counts approvals: routes/log.py).
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, HTTPException, Response, status
from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dpledger.service.api.deps import READERS, DbDep, PrincipalDep
from dpledger.service.api.receipts import SignerDep
from dpledger.service.ledger import transparency
from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.wire import note
from dpledger.wire.enums import Role

router = APIRouter(prefix="/v1/log", tags=["transparency"])
MEDIA_TYPE = "text/plain; charset=utf-8"


class OriginSettings(BaseSettings):
    """The log's origin line and key name; read at first use (a ledger's whole life: pin it)."""

    model_config = SettingsConfigDict(env_prefix="DPLEDGER_")
    log_origin: str | None = None

    @field_validator("log_origin")
    @classmethod
    def _a_key_name(cls, value: str | None) -> str | None:
        if value is not None and not note.valid_name(value):
            raise ValueError(f"DPLEDGER_LOG_ORIGIN must be a key name: non-empty, no space, no '+'; found {value!r}")
        return value


@functools.lru_cache(maxsize=1)
def configured_origin() -> str | None:
    return OriginSettings().log_origin


def default_origin(key_id: str) -> str:
    return f"dpledger.log/{key_id[:16]}"


def log_signer(signer: TreeHeadSigner) -> note.Signer:
    return signer.note_signer(configured_origin() or default_origin(signer.key_id))


def checkpoint_text(signer: TreeHeadSigner, *, size: int, root_hash: str) -> str:
    log = log_signer(signer)
    return note.sign(note.Checkpoint(log.name, size, bytes.fromhex(root_hash)).body(), [log])


@router.get(
    "/checkpoint", name="log_checkpoint", response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                     "description": "the checkpoint's signed note: origin, tree size, base64 root hash, a blank line, "
                                    "`— <origin> base64(key ID || Ed25519 signature)`"}},
)
def checkpoint(caller: PrincipalDep, db: DbDep, signer: SignerDep) -> Response:
    """The log's current head as a C2SP checkpoint signed note. Its verifier key, to pin and give to
    witnesses: `<origin>+<key ID>+<base64(0x01 || public key)>` (`dpledger witness log-key`)."""
    if caller.role is Role.coordinator:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the coordinator may not read the log: its size counts approvals")
    caller.require(*READERS, Role.silo)
    with db.read() as session:
        size, root = transparency.size_and_root(session)
    return Response(checkpoint_text(signer, size=size, root_hash=root), media_type=MEDIA_TYPE)
