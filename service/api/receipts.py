"""Signs a receipt for an answer that changed a budget: the head of the tree just after the entry,
stamped with the entry's own time. Each answer gets its own signature (Ed25519 costs tens of
microseconds, README "Receipts"), made after the write transaction so that no lock waits for it;
Ed25519 is deterministic, so a replayed request gets the very receipt of the first answer."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from dpledger.service.ledger.signer import TreeHeadSigner
from dpledger.service.ledger.transparency import Position
from dpledger.wire.receipts import Receipt


def signer(request: Request) -> TreeHeadSigner:
    stored: TreeHeadSigner = request.app.state.signer  # Starlette's state is untyped; app.py stores it
    return stored


SignerDep = Annotated[TreeHeadSigner, Depends(signer)]


def receipt(signer: TreeHeadSigner, position: Position) -> Receipt:
    return Receipt(
        silo_id=position.silo_id, seq=position.seq, log_index=position.log_index, leaf_hash=position.leaf_hash,
        tree_head=signer.sign(tree_size=position.tree_size, root_hash=position.root_hash, timestamp=position.timestamp),
        inclusion_path=position.path,
    )
