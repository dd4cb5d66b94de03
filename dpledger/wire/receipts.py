"""Signed tree heads and receipts of the transparency log, as they travel and as a client checks them.

A signed tree head (STH) is the ledger operator's signed statement "the log of every ledger entry
had `tree_size` leaves with root `root_hash` at `timestamp`" (RFC 9162 §4.10, in our own encoding
below). A receipt comes with every answer that changes a budget. An approval does not wait for the
log: its receipt carries the entry's leaf hash and a signed promise that the leaf will be in the log
by a deadline (Certificate Transparency's signed certificate timestamp, RFC 6962 §3.2; Rekor's signed
entry timestamp). `dpledger verify --receipts` later fetches the inclusion proof; a promise whose
deadline passed without the leaf in the log is itself the proof of misbehaviour. A receipt read
after its entry was sequenced also carries the head of its batch and the inclusion path to it.
Whoever holds a receipt can later prove what the ledger said, and two heads of one size with
different roots, both validly signed, prove that the operator showed different logs to different
parties.

Only pydantic, the standard library and `cryptography`: a silo's client imports this, never the
service.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from dpledger.wire import merkle


def default_receipts_dir() -> Path:
    """Where a silo's receipts are kept unless told otherwise: $DPLEDGER_RECEIPTS, else
    ~/.local/share/dpledger/receipts. Here, so that the client that writes them and `dpledger verify
    --receipts` that reads them agree on one place."""
    return Path(os.environ.get("DPLEDGER_RECEIPTS") or Path.home() / ".local/share/dpledger/receipts").expanduser()


Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="32 bytes, lowercase hex")]
# Fixed-width fields, so that no two heads encode to the same bytes.
_HEAD_PREFIX = b"dpledger tree head v1\x00"
_HEAD_LAYOUT = struct.Struct(">QQ32s32s")
_PROMISE_PREFIX = b"dpledger entry promise v1\x00"
_PROMISE_LAYOUT = struct.Struct(">32sQQQQ32s")  # leaf hash, silo, seq, timestamp, deadline, key id


RECEIPT_NOTE = "the entry's place in the signed transparency log: keep it to prove later what the ledger said"


class SignedTreeHead(BaseModel):
    tree_size: int = Field(ge=0, description="leaves in the log, every ledger entry of every silo")
    root_hash: Hex32 = Field(description="RFC 9162 Merkle tree hash of those leaves")
    timestamp: int = Field(ge=0, description="milliseconds since the Unix epoch, when the head was signed")
    key_id: Hex32 = Field(description="SHA-256 of the raw Ed25519 public key that signed it")
    signature: str = Field(description="Ed25519 over the encoded head, base64")


class Promise(BaseModel):
    """The log key's signed promise that the leaf will be in the log by `deadline` (an SCT)."""

    leaf_hash: Hex32
    silo_id: int = Field(ge=0)
    seq: int = Field(ge=0)
    timestamp: int = Field(ge=0, description="milliseconds since the Unix epoch: when the entry was written")
    deadline: int = Field(ge=0, description="milliseconds since the Unix epoch: the leaf is in the log by then")
    key_id: Hex32 = Field(description="SHA-256 of the raw Ed25519 public key that signed it")
    signature: str = Field(description="Ed25519 over the encoded promise, base64")


class Receipt(BaseModel):
    """The ledger's signed word about an entry: its promise that the entry will be in the log by a
    deadline, and, once it is (a receipt read later), the head of its batch and the path to it.
    Receipts kept before promises existed carry the head and path alone. Keep it, check it later."""

    silo_id: int
    seq: int = Field(description="the entry's place in its silo's hash chain")
    leaf_hash: Hex32 = Field(description="SHA-256(0x00 || the entry's leaf record)")
    promise: Promise | None = Field(None, description="the signed promise that the leaf is in the log by its deadline")
    log_index: int | None = Field(None, description="the entry's leaf index in the transparency log, once sequenced")
    tree_head: SignedTreeHead | None = Field(None, description="a signed head whose tree includes the entry")
    inclusion_path: list[Hex32] | None = Field(None, description="RFC 9162 §2.1.3 path from the leaf to tree_head's root")

    @model_validator(mode="after")
    def _promised_or_included(self) -> Receipt:
        included = (self.log_index, self.tree_head, self.inclusion_path)
        if any(v is None for v in included) and any(v is not None for v in included):
            raise ValueError("log_index, tree_head and inclusion_path come together")
        if self.promise is None and self.log_index is None:
            raise ValueError("a receipt carries a promise, an inclusion in a signed head, or both")
        return self

    @property
    def included(self) -> bool:
        return self.log_index is not None


class PublicKey(BaseModel):
    algorithm: str = "ed25519"
    public_key: Hex32 = Field(description="the raw 32-byte Ed25519 public key, hex")
    key_id: Hex32


class InclusionProof(BaseModel):
    log_index: int
    tree_size: int
    leaf_hash: Hex32
    path: list[Hex32]


class ConsistencyProof(BaseModel):
    first: int
    second: int
    path: list[Hex32]


class LogLeaf(BaseModel):
    log_index: int
    leaf_hash: Hex32
    record: str | None = Field(
        description="the entry's leaf record (canonical JSON; its leaf hash is SHA-256(0x00 || UTF-8 bytes)); "
        "null where the caller may not read that entry"
    )


class HeadError(ValueError):
    """A head that was not signed by the key it claims, or a receipt that does not hold together."""


def key_id(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()


def head_message(*, tree_size: int, timestamp: int, root_hash: str, key: str) -> bytes:
    """The bytes an STH's signature covers."""
    return _HEAD_PREFIX + _HEAD_LAYOUT.pack(tree_size, timestamp, bytes.fromhex(root_hash), bytes.fromhex(key))


def promise_message(*, leaf_hash: str, silo_id: int, seq: int, timestamp: int, deadline: int, key: str) -> bytes:
    """The bytes a promise's signature covers (a prefix of its own: never a head's bytes)."""
    return _PROMISE_PREFIX + _PROMISE_LAYOUT.pack(
        bytes.fromhex(leaf_hash), silo_id, seq, timestamp, deadline, bytes.fromhex(key)
    )


def _verify_signature(public_key: bytes, signature: str, message: bytes) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    Ed25519PublicKey.from_public_bytes(public_key).verify(base64.b64decode(signature, validate=True), message)


def verify_promise(promise: Promise, public_key: bytes) -> None:
    """Raises HeadError unless `public_key` signed exactly this promise."""
    from cryptography.exceptions import InvalidSignature

    if promise.key_id != key_id(public_key):
        raise HeadError(f"the promise names key {promise.key_id[:16]}…, not the pinned key {key_id(public_key)[:16]}…")
    message = promise_message(leaf_hash=promise.leaf_hash, silo_id=promise.silo_id, seq=promise.seq,
                              timestamp=promise.timestamp, deadline=promise.deadline, key=promise.key_id)
    try:
        _verify_signature(public_key, promise.signature, message)
    except (InvalidSignature, ValueError) as error:
        raise HeadError(f"the promise of silo {promise.silo_id} entry {promise.seq} does not carry a valid "
                        "signature of the pinned key") from error


def verify_head(head: SignedTreeHead, public_key: bytes) -> None:
    """Raises HeadError unless `public_key` signed exactly this head."""
    from cryptography.exceptions import InvalidSignature

    if head.key_id != key_id(public_key):
        raise HeadError(f"the head names key {head.key_id[:16]}…, not the pinned key {key_id(public_key)[:16]}…")
    try:
        _verify_signature(public_key, head.signature, head_message(
            tree_size=head.tree_size, timestamp=head.timestamp, root_hash=head.root_hash, key=head.key_id))
    except (InvalidSignature, ValueError) as error:
        raise HeadError(f"the head of size {head.tree_size} does not carry a valid signature of the pinned key") from error


def record_leaf_hash(record: str) -> str:
    return merkle.leaf_hash(record.encode()).hex()


def check_receipt(receipt: Receipt, public_key: bytes) -> None:
    """The receipt on its own: its promise is signed by the pinned key for this very entry and leaf,
    and, where it carries one, its head is signed too and its path leads from the leaf to that
    head's root. (That the leaf is still the entry's, and in today's log, is checked against the
    ledger: `dpledger verify --receipts`.)"""
    if receipt.promise is not None:
        promise = receipt.promise
        if (promise.leaf_hash, promise.silo_id, promise.seq) != (receipt.leaf_hash, receipt.silo_id, receipt.seq):
            raise HeadError(f"receipt of silo {receipt.silo_id} entry {receipt.seq}: its promise is for another entry "
                            f"(silo {promise.silo_id} entry {promise.seq}, leaf {promise.leaf_hash[:16]}…)")
        verify_promise(promise, public_key)
    if receipt.log_index is None or receipt.tree_head is None or receipt.inclusion_path is None:
        return
    verify_head(receipt.tree_head, public_key)
    try:
        merkle.verify_inclusion(
            index=receipt.log_index, size=receipt.tree_head.tree_size, leaf=bytes.fromhex(receipt.leaf_hash),
            path=[bytes.fromhex(p) for p in receipt.inclusion_path], root_hash=bytes.fromhex(receipt.tree_head.root_hash),
        )
    except merkle.ProofError as error:
        raise HeadError(f"receipt of log index {receipt.log_index}: {error}") from error


def is_fork(a: SignedTreeHead, b: SignedTreeHead, public_key: bytes) -> bool:
    """Two heads of one size with different roots, both signed by the key: the operator kept two
    logs. Such a pair is a proof of misbehaviour that anyone holding the public key can check."""
    verify_head(a, public_key)
    verify_head(b, public_key)
    return a.tree_size == b.tree_size and a.root_hash != b.root_hash
