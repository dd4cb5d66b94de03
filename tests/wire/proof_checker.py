"""An independent checker of the proofs `dpledger verify --receipts` and `audit` print: written from
RFC 9162 (§2.1.1 hashing, §2.1.3.2 inclusion) and the byte layouts of a signed head and a promise
(dpledger/wire/receipts.py's docstring), importing nothing of dpledger. A proof of misbehaviour must
convince someone who holds only the log's public key: each test hands it what was printed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def leaf(data: bytes) -> bytes:
    return _h(b"\x00" + data)


def mth(leaves: list[bytes]) -> bytes:
    """RFC 9162 §2.1.1 over leaf hashes, recursively, as written there."""
    if not leaves:
        return _h(b"")
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return _h(b"\x01" + mth(leaves[:k]) + mth(leaves[k:]))


def inclusion_root(index: int, size: int, leaf_hash: bytes, path: list[bytes]) -> bytes:
    """RFC 9162 §2.1.3.2, step by step."""
    assert 0 <= index < size
    fn, sn, r = index, size - 1, leaf_hash
    for p in path:
        assert sn != 0, "path too long"
        if fn % 2 == 1 or fn == sn:
            r = _h(b"\x01" + p + r)
            while fn % 2 == 0 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = _h(b"\x01" + r + p)
        fn >>= 1
        sn >>= 1
    assert sn == 0, "path too short"
    return r


def _verify(public_key: bytes, signature_b64: str, message: bytes) -> None:
    Ed25519PublicKey.from_public_bytes(public_key).verify(base64.b64decode(signature_b64), message)  # raises if not


def check_head(head: dict[str, Any], public_key: bytes) -> None:
    """"dpledger tree head v1" NUL, then size, timestamp (u64 big-endian), root, key id (32 bytes each)."""
    assert head["key_id"] == hashlib.sha256(public_key).hexdigest()
    message = b"dpledger tree head v1\x00" + struct.pack(">QQ", head["tree_size"], head["timestamp"]) \
        + bytes.fromhex(head["root_hash"]) + bytes.fromhex(head["key_id"])
    _verify(public_key, head["signature"], message)


def check_promise(promise: dict[str, Any], public_key: bytes) -> None:
    """"dpledger entry promise v1" NUL, leaf hash, then silo, seq, timestamp, deadline (u64), key id."""
    assert promise["key_id"] == hashlib.sha256(public_key).hexdigest()
    message = b"dpledger entry promise v1\x00" + bytes.fromhex(promise["leaf_hash"]) + struct.pack(
        ">QQQQ", promise["silo_id"], promise["seq"], promise["timestamp"], promise["deadline"]) \
        + bytes.fromhex(promise["key_id"])
    _verify(public_key, promise["signature"], message)


def check_proof(evidence: dict[str, Any]) -> str:
    """Checks one printed proof of misbehaviour on its own; returns its kind. Raises if it does not hold."""
    public_key = bytes.fromhex(evidence["public_key"])
    if "heads" in evidence:  # two heads of one size, both signed, two roots
        a, b = evidence["heads"]
        check_head(a, public_key)
        check_head(b, public_key)
        assert a["tree_size"] == b["tree_size"] and a["root_hash"] != b["root_hash"]
        return "fork"
    head = evidence["head"]
    check_head(head, public_key)
    if "promise" in evidence:  # promised by a deadline; a head signed after it, whose every leaf is listed
        promise = evidence["promise"]
        check_promise(promise, public_key)
        assert head["timestamp"] >= promise["deadline"]
        leaves = [bytes.fromhex(h) for h in evidence["leaf_hashes"]]
        assert len(leaves) == head["tree_size"] and mth(leaves).hex() == head["root_hash"]
        assert bytes.fromhex(promise["leaf_hash"]) not in leaves
        return "broken promise"
    # entries the head holds, each record its leaf: what they state is there for anyone to recompose
    assert evidence["entries"]
    for entry in evidence["entries"]:
        record = entry["record"].encode()
        root = inclusion_root(entry["log_index"], head["tree_size"], leaf(record),
                              [bytes.fromhex(p) for p in entry["inclusion_path"]])
        assert root.hex() == head["root_hash"], f"log index {entry['log_index']} is not in the signed head"
        json.loads(record)
    return "signed entries"
