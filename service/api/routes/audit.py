from __future__ import annotations

from fastapi import APIRouter

from dpledger.service.api.deps import READERS, DbDep, PrincipalDep
from dpledger.service.ledger import audit
from dpledger.wire.schemas import VerifyResponse

router = APIRouter(prefix="/v1/audit", tags=["audit"])


@router.get("/verify", response_model=VerifyResponse, name="verify_ledger")
def verify_ledger(caller: PrincipalDep, db: DbDep) -> VerifyResponse:
    """Recomputes every hash of every silo's chain from the stored rows."""
    caller.require(*READERS)
    with db.read() as session:
        report = audit.verify(session)
    return VerifyResponse(
        ok=report.ok, entries=report.entries, first_bad_seq=report.first_bad_seq,
        first_bad_silo_id=report.first_bad_silo_id, bad_charge_ids=report.bad_charge_ids, problems=report.problems,
    )
