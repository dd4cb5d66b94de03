"""The Ed25519 key that signs the transparency log's tree heads, loaded from a file or the environment
(service/settings.py), never from the database it vouches for."""

from __future__ import annotations

import base64
import logging
import time

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpledger.service.settings import Settings
from dpledger.wire import note
from dpledger.wire.receipts import Promise, PublicKey, SignedTreeHead, head_message, key_id, promise_message

log = logging.getLogger("dpledger.signer")


class SigningKeyError(ValueError):
    """The configured key cannot be read: the service refuses to start rather than sign with another."""


class TreeHeadSigner:
    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = key_id(self.public_key)

    def sign(self, *, tree_size: int, root_hash: str, timestamp: int | None = None) -> SignedTreeHead:
        stamp = int(time.time() * 1000) if timestamp is None else timestamp
        message = head_message(tree_size=tree_size, timestamp=stamp, root_hash=root_hash, key=self.key_id)
        return SignedTreeHead(
            tree_size=tree_size, root_hash=root_hash, timestamp=stamp, key_id=self.key_id,
            signature=base64.b64encode(self._key.sign(message)).decode(),
        )

    def promise(self, *, leaf_hash: str, silo_id: int, seq: int, timestamp: int, deadline: int) -> Promise:
        """The signed promise that the leaf will be in the log by `deadline` (deterministic, like a head)."""
        message = promise_message(leaf_hash=leaf_hash, silo_id=silo_id, seq=seq, timestamp=timestamp,
                                  deadline=deadline, key=self.key_id)
        return Promise(leaf_hash=leaf_hash, silo_id=silo_id, seq=seq, timestamp=timestamp, deadline=deadline,
                       key_id=self.key_id, signature=base64.b64encode(self._key.sign(message)).decode())

    def note_signer(self, name: str) -> note.Signer:
        """This key as a C2SP note signer under `name` (the log's origin): a checkpoint is signed by the
        very key that signs the heads and promises. A note's text holds no NUL, which the bytes of a
        head or a promise always do, so one key serves the three without ambiguity."""
        return note.Signer(name, self._key)

    def public(self) -> PublicKey:
        return PublicKey(public_key=self.public_key.hex(), key_id=self.key_id)


def parse_private_key(material: bytes) -> Ed25519PrivateKey:
    """A PEM (PKCS#8) Ed25519 private key, or its 32-byte seed in hex."""
    text = material.strip()
    try:
        if text.startswith(b"-----BEGIN"):
            key = serialization.load_pem_private_key(text, password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise SigningKeyError(f"the signing key is a {type(key).__name__}, not an Ed25519 key")
            return key
        seed = bytes.fromhex(text.decode())
        return Ed25519PrivateKey.from_private_bytes(seed)
    except (ValueError, UnicodeDecodeError, TypeError) as error:
        if isinstance(error, SigningKeyError):
            raise
        raise SigningKeyError("the signing key is neither an Ed25519 PEM private key nor a 32-byte hex seed") from error


def load_signer(settings: Settings) -> TreeHeadSigner:
    if settings.signing_key_file is not None:
        try:
            material = settings.signing_key_file.read_bytes()
        except OSError as error:
            raise SigningKeyError(
                f"cannot read DPLEDGER_SIGNING_KEY_FILE {settings.signing_key_file}: {error.strerror}"
            ) from error
        return TreeHeadSigner(parse_private_key(material))
    if settings.signing_key is not None:
        return TreeHeadSigner(parse_private_key(settings.signing_key.get_secret_value().encode()))
    if settings.env == "production":  # the settings refuse this already; kept in case they are built another way
        raise SigningKeyError("no signing key configured in production")
    signer = TreeHeadSigner(Ed25519PrivateKey.generate())
    log.warning(
        "no DPLEDGER_SIGNING_KEY_FILE: signing tree heads with an ephemeral key %s… that dies with this "
        "process; receipts signed with it cannot be checked after a restart (development only)", signer.key_id[:16],
    )
    return signer


def ephemeral_seed() -> str:
    """A fresh seed in hex, for `dpledger serve` to hand its workers one shared development key."""
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    ).hex()
