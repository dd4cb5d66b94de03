"""Signed tree heads and receipts of the transparency log, as they travel and as a client checks them.

A signed tree head (STH) is the ledger operator's signed statement "the log of every ledger entry
had `tree_size` leaves with root `root_hash` at `timestamp`" (RFC 9162 §4.10, in our own encoding
below). A receipt comes with every answer that changes a budget: the entry's leaf, a head that
includes it and the inclusion path between them. Whoever holds a receipt can later prove what the
ledger said, and two heads of one size with different roots, both validly signed, prove that the
operator showed different logs to different parties.

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

from pydantic import BaseModel, Field

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


RECEIPT_NOTE = "the entry's place in the signed transparency log: keep it to prove later what the ledger said"


class SignedTreeHead(BaseModel):
    tree_size: int = Field(ge=0, description="leaves in the log, every ledger entry of every silo")
    root_hash: Hex32 = Field(description="RFC 9162 Merkle tree hash of those leaves")
    timestamp: int = Field(ge=0, description="milliseconds since the Unix epoch, when the head was signed")
    key_id: Hex32 = Field(description="SHA-256 of the raw Ed25519 public key that signed it")
    signature: str = Field(description="Ed25519 over the encoded head, base64")


class Receipt(BaseModel):
    """The ledger's signed word that an entry is in its log: keep it, check it later."""

    silo_id: int
    seq: int = Field(description="the entry's place in its silo's hash chain")
    log_index: int = Field(description="the entry's leaf index in the transparency log")
    leaf_hash: Hex32 = Field(description="SHA-256(0x00 || the entry's leaf record)")
    tree_head: SignedTreeHead = Field(description="a signed head whose tree includes the entry")
    inclusion_path: list[Hex32] = Field(description="RFC 9162 §2.1.3 path from the leaf to tree_head's root")


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


def verify_head(head: SignedTreeHead, public_key: bytes) -> None:
    """Raises HeadError unless `public_key` signed exactly this head."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if head.key_id != key_id(public_key):
        raise HeadError(f"the head names key {head.key_id[:16]}…, not the pinned key {key_id(public_key)[:16]}…")
    try:
        signature = base64.b64decode(head.signature, validate=True)
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            signature, head_message(tree_size=head.tree_size, timestamp=head.timestamp, root_hash=head.root_hash, key=head.key_id)
        )
    except (InvalidSignature, ValueError) as error:
        raise HeadError(f"the head of size {head.tree_size} does not carry a valid signature of the pinned key") from error


def record_leaf_hash(record: str) -> str:
    return merkle.leaf_hash(record.encode()).hex()


def check_receipt(receipt: Receipt, public_key: bytes) -> None:
    """The receipt on its own: its head is signed by the pinned key and its path leads from the
    leaf to that head's root. (That the leaf is still the entry's is checked against the ledger.)"""
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
