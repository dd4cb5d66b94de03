"""Signs a receipt for an answer that changed a budget. Each answer gets its own head (an Ed25519
signature costs tens of microseconds, README "Receipts"), signed after the write transaction so
that no lock is held for it."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.ledger.transparency import Position
from dpledger.wire.receipts import Receipt


def signer(request: Request) -> TreeHeadSigner:
    return request.app.state.signer  # type: ignore[no-any-return]


SignerDep = Annotated[TreeHeadSigner, Depends(signer)]


def receipt(signer: TreeHeadSigner, position: Position) -> Receipt:
    return Receipt(
        silo_id=position.silo_id, seq=position.seq, log_index=position.log_index, leaf_hash=position.leaf_hash,
        tree_head=signer.sign(tree_size=position.tree_size, root_hash=position.root_hash),
        inclusion_path=position.path,
    )
