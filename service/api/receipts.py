"""Signs a receipt for an answer that changed a budget: the log key's promise that the entry's leaf
is in the log by its deadline and, once it is (a receipt read later), the head of its batch with the
inclusion path. Each answer gets its own signature (Ed25519 costs tens of microseconds, README
"Receipts"), made after the write transaction so that no lock waits for it; Ed25519 is
deterministic, so a replayed request gets the very promise of the first answer."""

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
    promise = None if position.deadline is None else signer.promise(
        leaf_hash=position.leaf_hash, silo_id=position.silo_id, seq=position.seq, timestamp=position.timestamp,
        deadline=position.deadline,
    )
    included = position.included
    if included is None:
        return Receipt(silo_id=position.silo_id, seq=position.seq, leaf_hash=position.leaf_hash, promise=promise)
    head = included.head if included.head is not None else signer.sign(
        tree_size=included.tree_size, root_hash=included.root_hash, timestamp=included.timestamp
    )
    return Receipt(
        silo_id=position.silo_id, seq=position.seq, leaf_hash=position.leaf_hash, promise=promise,
        log_index=included.log_index, tree_head=head, inclusion_path=included.path,
    )
