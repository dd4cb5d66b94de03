"""The transparency log over HTTP: signed heads, inclusion and consistency proofs, leaves, the key.

Who reads what: admins and auditors everything; a silo every head and proof (hashes only) and the
records of its own entries, never another silo's (a salted leaf hash says nothing about them). The
coordinator reads nothing but the public key: the log's size counts approvals, and approvals depend
on budgets, while the coordinator's answers must be the same whatever budgets the silos hold.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status
from pydantic import TypeAdapter

from dpledger.service.api.deps import READERS, DbDep, PrincipalDep
from dpledger.service.api.receipts import SignerDep
from dpledger.service.ledger import transparency
from dpledger.service.ledger.errors import InvalidRequest
from dpledger.wire.enums import Role
from dpledger.wire.log_proofs import MAX_PROOFS, LogProofs
from dpledger.wire.receipts import (
    ConsistencyProof,
    HeadError,
    InclusionProof,
    LogLeaf,
    PublicKey,
    SignedTreeHead,
    verify_head,
)

router = APIRouter(prefix="/v1/log", tags=["transparency"])

Size = Annotated[int | None, Query(ge=0, le=2**62, description="a past tree size (default: the current one)")]
Index = Annotated[int, Query(ge=0, le=2**62)]
LOG_READERS = (*READERS, Role.silo)


def _may_read_log(caller: PrincipalDep) -> None:
    if caller.role is Role.coordinator:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the coordinator may not read the log: its size counts approvals")
    caller.require(*LOG_READERS)


@router.get("/public-key", response_model=PublicKey, name="log_public_key")
def public_key(caller: PrincipalDep, signer: SignerDep) -> PublicKey:
    """The Ed25519 key that signs every tree head: pin it (`dpledger pubkey`), out of band if you can."""
    return signer.public()


@router.get("/head", response_model=SignedTreeHead, name="log_head")
def head(caller: PrincipalDep, db: DbDep, signer: SignerDep, size: Size = None) -> SignedTreeHead:
    """The log's signed head now, or the head it had at an earlier `size` (signed now)."""
    _may_read_log(caller)
    with db.read() as session:
        tree_size, root = transparency.root_at(session, size)
    return signer.sign(tree_size=tree_size, root_hash=root)


@router.get("/proofs/inclusion", response_model=InclusionProof, name="log_inclusion_proof")
def inclusion_proof(caller: PrincipalDep, db: DbDep, index: Index, size: Size = None) -> InclusionProof:
    """RFC 9162 §2.1.3: the path from leaf `index` to the root of the tree of `size` leaves. A silo
    may ask only for its own entries."""
    _may_read_log(caller)
    with db.read() as session:
        leaf = transparency.leaf(session, index)
        if caller.role is Role.silo:
            entry, _ = transparency.record_of(session, leaf)
            if entry is None or entry.silo_id != caller.silo_id:
                raise HTTPException(status.HTTP_403_FORBIDDEN, "a silo key may ask for proofs of its own entries only")
        tree_size, path = transparency.inclusion(session, index, size)
    return InclusionProof(log_index=index, tree_size=tree_size, leaf_hash=leaf.leaf_hash, path=path)


@router.get("/proofs/by-hash", response_model=InclusionProof, name="log_inclusion_by_hash",
            responses={404: {"description": "no leaf with this hash in the log yet (`detail` says whether it is pending)"}})
def inclusion_by_hash(caller: PrincipalDep, db: DbDep, leaf_hash: Annotated[str, Query(pattern=r"^[0-9a-f]{64}$")],
                      size: Size = None) -> InclusionProof:
    """RFC 6962's get-proof-by-hash: where a receipt's promised leaf sits, and its path to the tree of
    `size` leaves (default: the current one). 404 while the leaf waits for the sequencer: ask again
    until the receipt's promised deadline (past it, the promise is broken). A silo: its own entries only."""
    _may_read_log(caller)
    with db.read() as session:
        leaf = transparency.index_of_leaf(session, leaf_hash)
        if leaf is None:
            pending = transparency.is_pending(session, leaf_hash)
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"leaf {leaf_hash[:16]}… is pending: not sequenced yet"
                                if pending else f"no leaf {leaf_hash[:16]}… in the log")
        if caller.role is Role.silo:
            entry, _ = transparency.record_of(session, leaf)
            if entry is None or entry.silo_id != caller.silo_id:
                raise HTTPException(status.HTTP_403_FORBIDDEN, "a silo key may ask for proofs of its own entries only")
        if size is not None and size <= leaf.idx:
            raise InvalidRequest("size", f"must be above the leaf's index {leaf.idx}; found {size}")
        tree_size, path = transparency.inclusion(session, leaf.idx, size)
    return InclusionProof(log_index=leaf.idx, tree_size=tree_size, leaf_hash=leaf.leaf_hash, path=path)


@router.get("/proofs/consistency", response_model=ConsistencyProof, name="log_consistency_proof")
def consistency_proof(caller: PrincipalDep, db: DbDep, first: Annotated[int, Query(ge=0, le=2**62)],
                      second: Size = None) -> ConsistencyProof:
    """RFC 9162 §2.1.4: the tree of `second` leaves extends the tree of `first` leaves."""
    _may_read_log(caller)
    with db.read() as session:
        tree_size, path = transparency.consistency(session, first, second)
    return ConsistencyProof(first=first, second=tree_size, path=path)


def _index_list(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidRequest(name, f"must be comma-separated log indices or sizes; found {text[:40]!r}") from None
    if len(values) > MAX_PROOFS:
        raise InvalidRequest(name, f"at most {MAX_PROOFS} per request; found {len(values)}")
    return values


@router.get("/proofs", response_model=LogProofs, name="log_proofs")
def proofs(caller: PrincipalDep, db: DbDep, size: Size = None,
           inclusion: Annotated[str, Query(max_length=10_000, description="comma-separated leaf indices")] = "",
           consistency: Annotated[str, Query(max_length=10_000, description="comma-separated earlier sizes")] = "",
           ) -> LogProofs:
    """Inclusion proofs of many leaves and consistency proofs from many earlier sizes, all against the
    tree of `size` leaves (default: the current one), in one answer. A silo may ask inclusion proofs
    of its own entries only."""
    _may_read_log(caller)
    indices, firsts = _index_list("inclusion", inclusion), _index_list("consistency", consistency)
    with db.read() as session:
        rows = transparency.leaves_at(session, indices)
        if caller.role is Role.silo and any(entry is None or entry.silo_id != caller.silo_id
                                            for entry, _ in transparency.records_of(session, rows)):
            raise HTTPException(status.HTTP_403_FORBIDDEN, "a silo key may ask for proofs of its own entries only")
        tree_size, included, extended = transparency.proofs(session, size=size, indices=indices, firsts=firsts)
    hashes = {row.idx: row.leaf_hash for row in rows}
    missing = sorted(set(indices) - set(hashes))
    if missing:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"log index {missing[0]} not found")
    return LogProofs(
        tree_size=tree_size,
        inclusion=[InclusionProof(log_index=i, tree_size=tree_size, leaf_hash=hashes[i], path=p)
                   for i, p in zip(indices, included, strict=True)],
        consistency=[ConsistencyProof(first=f, second=tree_size, path=p) for f, p in zip(firsts, extended, strict=True)],
    )


@router.get("/leaves", response_model=list[LogLeaf], name="log_leaves")
def leaves(caller: PrincipalDep, db: DbDep, start: Index = 0,
           limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
           silo_id: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="only this silo's entries")] = None,
           ) -> Response:
    """Leaf hashes in log order, each with its entry's record where the caller may read that entry
    (recomputed from the live rows: the leaf hash must match it, or the entry was edited). With
    `silo_id`, only that silo's leaves (a silo key: its own only)."""
    _may_read_log(caller)
    if silo_id is not None and caller.role is Role.silo and silo_id != caller.silo_id:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a silo key may list its own entries only")
    out = []
    with db.read() as session:
        rows = (transparency.leaves(session, start=start, limit=limit) if silo_id is None
                else transparency.silo_leaves(session, silo_id, start=start, limit=limit))
        for row, (entry, record) in zip(rows, transparency.records_of(session, rows), strict=True):
            visible = caller.role in READERS or (entry is not None and entry.silo_id == caller.silo_id)
            # Built from the ledger's own rows, so not validated again (a page holds 10,000 of them).
            out.append(LogLeaf.model_construct(log_index=row.idx, leaf_hash=row.leaf_hash, record=record if visible else None))
    # Serialized here, once: FastAPI would validate the models it was just handed again (a page of
    # 10,000 leaves is ~40 MB of records, and that second pass cost as much as building them).
    return Response(_LEAVES.dump_json(out), media_type="application/json")


_LEAVES: TypeAdapter[list[LogLeaf]] = TypeAdapter(list[LogLeaf])


@router.post("/verified", status_code=status.HTTP_201_CREATED, response_model=SignedTreeHead, name="log_record_verified_head")
def record_verified_head(head: SignedTreeHead, caller: PrincipalDep, db: DbDep, signer: SignerDep) -> SignedTreeHead:
    """An auditor's `dpledger audit` reports the head it verified, for the dashboard to show."""
    caller.require(Role.auditor, Role.admin)
    try:
        verify_head(head, signer.public_key)
    except HeadError as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"not a head this ledger signed: {error}") from error
    with db.write() as session:
        transparency.record_verified(session, head, api_key_id=caller.key_id)
    return head
