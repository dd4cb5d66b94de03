"""C2SP signed notes, transparency-log checkpoints and witness cosignatures, byte for byte as the
ecosystem writes them (Go's checksum database, Sigstore's Rekor v2, static CT logs, their witnesses).

- A signed note (c2sp.org/signed-note): a UTF-8 text ending in a newline, a blank line, then one or
  more lines `— <key name> base64(key ID || signature)`. The key ID is the first four bytes of
  SHA-256(key name || 0x0A || signature type || public key), read big-endian; type 0x01 is Ed25519
  over the text. A verifier ignores signatures of keys it does not know (same name and ID), must
  verify those it knows, and rejects a note that none of them signed.
- A checkpoint (c2sp.org/tlog-checkpoint): a note whose text is the log's origin, its tree size in
  decimal, the base64 RFC 6962 root hash, then optional extension lines.
- A cosignature (c2sp.org/tlog-cosignature, Ed25519, type 0x04): a witness's note signature whose
  bytes are an 8-byte big-endian POSIX time then Ed25519 over
  "cosignature/v1\\ntime <t>\\n" || the checkpoint's text: "as of time t, this is the largest
  consistent tree I have seen for this origin".
- Keys print as Go's `golang.org/x/mod/sumdb/note` prints them: a verifier key
  `<name>+<key ID, 8 hex>+base64(type || public key)`, a signer key `PRIVATE+KEY+<name>+<key ID>+
  base64(type || 32-byte seed)`.

Parsing follows Go's `note.Open` rule for rule (tests/wire/test_note.py holds its published
vectors). Pure: the standard library and `cryptography`, no service import.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ED25519 = 0x01  # c2sp.org/signed-note: Ed25519 over the note text
COSIGNATURE_V1 = 0x04  # c2sp.org/tlog-cosignature: timestamped Ed25519 witness cosignature
MAX_SIGNATURES = 100  # Go's limit (the spec asks for at least 16): a note of many signatures is refused, not parsed
_SIG_PREFIX = "— "  # em dash, space
_COSIG_TIME = struct.Struct(">Q")
_DECIMAL = re.compile(r"^(0|[1-9][0-9]*)$")


class NoteError(ValueError):
    """A note, key or checkpoint that is malformed, or whose signatures do not verify."""


def valid_name(name: str) -> bool:
    """Key names (and so origins we sign as) are non-empty, with no Unicode space and no '+'."""
    return bool(name) and "+" not in name and not any(c.isspace() for c in name) and _no_controls(name)


def _no_controls(text: str) -> bool:
    return not any(ord(c) < 0x20 and c != "\n" for c in text)


def key_id(name: str, signature_type: int, public_key: bytes) -> int:
    """SHA-256(key name || 0x0A || signature type || public key)[:4], big-endian."""
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([signature_type]) + public_key).digest()
    return int.from_bytes(digest[:4], "big")


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise NoteError(f"not base64: {text[:24]!r}") from error


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class Signature:
    """One signature line: the key's name and ID, and the signature bytes after the ID."""

    name: str
    key_id: int
    signature: bytes

    def line(self) -> str:
        return f"{_SIG_PREFIX}{self.name} {_b64(self.key_id.to_bytes(4, 'big') + self.signature)}\n"

    @property
    def timestamp(self) -> int:
        """A cosignature/v1's time (POSIX seconds); NoteError if the bytes cannot be one."""
        if len(self.signature) != _COSIG_TIME.size + 64:
            raise NoteError(f"the signature of {self.name} is not a cosignature/v1 ({len(self.signature)} bytes)")
        return int(_COSIG_TIME.unpack_from(self.signature)[0])


@dataclass(frozen=True)
class VerifierKey:
    """A named Ed25519 public key of one signature type (0x01 note signer, 0x04 cosigner)."""

    name: str
    signature_type: int
    public_key: bytes

    def __post_init__(self) -> None:
        if not valid_name(self.name):
            raise NoteError(f"key name {self.name!r} is empty or holds a space, a '+' or a control character")
        if self.signature_type not in (ED25519, COSIGNATURE_V1):
            raise NoteError(f"signature type {self.signature_type:#04x} is neither Ed25519 (0x01) nor cosignature/v1 (0x04)")
        if len(self.public_key) != 32:
            raise NoteError(f"an Ed25519 public key has 32 bytes, not {len(self.public_key)}")

    @property
    def key_id(self) -> int:
        return key_id(self.name, self.signature_type, self.public_key)

    def encode(self) -> str:
        return f"{self.name}+{self.key_id:08x}+{_b64(bytes([self.signature_type]) + self.public_key)}"

    def __str__(self) -> str:
        return self.encode()

    @classmethod
    def parse(cls, vkey: str) -> VerifierKey:
        """`<name>+<8 hex>+<base64(type || key)>`, the ID checked against the key (Go's NewVerifier)."""
        name, _, rest = vkey.partition("+")
        hex_id, _, material = rest.partition("+")
        if len(hex_id) != 8 or not re.fullmatch(r"[0-9a-fA-F]{8}", hex_id) or not material:
            raise NoteError(f"not a verifier key <name>+<8 hex>+<base64>: {vkey[:60]!r}")
        raw = _b64decode(material)
        if len(raw) < 2:
            raise NoteError("the verifier key holds no key")
        key = cls(name, raw[0], raw[1:])
        if key.key_id != int(hex_id, 16):
            raise NoteError(f"verifier key {name}: its ID {hex_id} is not the hash of its name and key ({key.key_id:08x})")
        return key

    def as_cosigner(self) -> VerifierKey:
        """The same Ed25519 key as a cosignature/v1 verifier (transparency-dev's conversion of a 0x01 vkey)."""
        return VerifierKey(self.name, COSIGNATURE_V1, self.public_key)

    def verify(self, text: bytes, signature: bytes) -> bool:
        public = Ed25519PublicKey.from_public_bytes(self.public_key)
        if self.signature_type == COSIGNATURE_V1:
            if len(signature) != _COSIG_TIME.size + 64:
                return False
            (timestamp,) = _COSIG_TIME.unpack_from(signature)
            if timestamp > 2**63 - 1:
                return False
            text, signature = cosigned_message(text, timestamp), signature[_COSIG_TIME.size:]
        try:
            public.verify(signature, text)
            return True
        except (InvalidSignature, ValueError):  # ValueError: not 64 bytes
            return False


class Signer:
    """An Ed25519 private key under a name, signing as a note signer (0x01) or a cosigner (0x04)."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey, signature_type: int = ED25519) -> None:
        self._key = private_key
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.verifier = VerifierKey(name, signature_type, raw)

    @property
    def name(self) -> str:
        return self.verifier.name

    def sign(self, text: str, *, timestamp: int | None = None) -> Signature:
        """The signature line over `text`; a cosigner needs `timestamp` (POSIX seconds)."""
        body = text.encode()
        if self.verifier.signature_type == COSIGNATURE_V1:
            if timestamp is None or not 0 <= timestamp <= 2**63 - 1:
                raise NoteError(f"a cosignature needs a time in [0, 2^63 - 1]; found {timestamp}")
            raw = _COSIG_TIME.pack(timestamp) + self._key.sign(cosigned_message(body, timestamp))
        else:
            raw = self._key.sign(body)
        return Signature(self.name, self.verifier.key_id, raw)

    def encode(self) -> str:
        """`PRIVATE+KEY+<name>+<key ID>+base64(type || seed)`: Go's signer key format. A secret."""
        seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())
        return f"PRIVATE+KEY+{self.name}+{self.verifier.key_id:08x}+{_b64(bytes([self.verifier.signature_type]) + seed)}"

    @classmethod
    def parse(cls, skey: str) -> Signer:
        """A signer key as `encode` (or Go's note.GenerateKey) writes it; its ID is checked."""
        parts = skey.strip().split("+", 4)
        if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"] or not re.fullmatch(r"[0-9a-fA-F]{8}", parts[3]):
            raise NoteError("not a signer key PRIVATE+KEY+<name>+<8 hex>+<base64>")
        raw = _b64decode(parts[4])
        if len(raw) != 33:
            raise NoteError(f"a signer key holds a type byte and a 32-byte seed, not {len(raw)} bytes")
        signer = cls(parts[2], Ed25519PrivateKey.from_private_bytes(raw[1:]), raw[0])
        if signer.verifier.key_id != int(parts[3], 16):
            raise NoteError(f"signer key {parts[2]}: its ID {parts[3]} is not the hash of its name and public key")
        return signer

    @classmethod
    def generate(cls, name: str, signature_type: int = ED25519) -> Signer:
        return cls(name, Ed25519PrivateKey.generate(), signature_type)


def cosigned_message(text: bytes, timestamp: int) -> bytes:
    """What a cosignature/v1 signs: two header lines, then the checkpoint's whole text."""
    if text.count(b"\n") < 3:
        raise NoteError("a cosigned checkpoint has at least three lines")
    return b"cosignature/v1\ntime %d\n" % timestamp + text


@dataclass(frozen=True)
class Note:
    text: str
    signatures: tuple[Signature, ...]

    def encode(self) -> str:
        return self.text + "\n" + "".join(s.line() for s in self.signatures)


def parse(message: str | bytes) -> Note:
    """The note's text and every signature line, unverified (Go's Open, before it looks keys up).
    Repeated identical lines count once."""
    if isinstance(message, bytes):
        try:
            message = message.decode("utf-8")
        except UnicodeDecodeError as error:
            raise NoteError("a note is UTF-8") from error
    if not _no_controls(message):
        raise NoteError("a note holds no control character but newlines")
    split = message.rfind("\n\n")
    if split < 0:
        raise NoteError("a note's text and signatures are separated by a blank line")
    text, block = message[:split + 1], message[split + 2:]
    if not block or not block.endswith("\n"):
        raise NoteError("a note ends with signature lines, each ending in a newline")
    signatures: list[Signature] = []
    lines = block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise NoteError(f"a note of more than {MAX_SIGNATURES} signatures")
    for line in dict.fromkeys(lines):
        if not line.startswith(_SIG_PREFIX):
            raise NoteError(f"not a signature line: {line[:40]!r}")
        name, _, encoded = line[len(_SIG_PREFIX):].partition(" ")
        raw = _b64decode(encoded) if encoded else b""
        if not valid_name(name) or len(raw) < 5:
            raise NoteError(f"not a signature line: {line[:40]!r}")
        signatures.append(Signature(name, int.from_bytes(raw[:4], "big"), raw[4:]))
    return Note(text, tuple(signatures))


@dataclass(frozen=True)
class Opened:
    """A note whose text a known key signed: which known keys signed it (in note order), and the
    signatures of keys not known, kept but never believed."""

    note: Note
    verified: tuple[tuple[VerifierKey, Signature], ...]
    unverified: tuple[Signature, ...]

    def by(self, key: VerifierKey) -> Signature | None:
        return next((s for k, s in self.verified if k == key), None)


def open_note(message: str | bytes, known: Sequence[VerifierKey]) -> Opened:
    """Go's note.Open: signatures of unknown keys ignored, a known key's that fails refuses the whole
    note, and a note no known key signed is refused."""
    note = parse(message)
    keys: dict[tuple[str, int], list[VerifierKey]] = {}
    for key in known:
        if key not in keys.setdefault((key.name, key.key_id), []):
            keys[(key.name, key.key_id)].append(key)
    verified: list[tuple[VerifierKey, Signature]] = []
    unverified: list[Signature] = []
    seen: set[tuple[str, int]] = set()
    for sig in note.signatures:
        candidates = keys.get((sig.name, sig.key_id))
        if candidates is None:
            unverified.append(sig)
            continue
        if len(candidates) > 1:
            raise NoteError(f"ambiguous key {sig.name}+{sig.key_id:08x}")
        if (sig.name, sig.key_id) in seen:
            continue  # Go drops a known key's repeated signatures
        seen.add((sig.name, sig.key_id))
        if not candidates[0].verify(note.text.encode(), sig.signature):
            raise NoteError(f"invalid signature for key {sig.name}+{sig.key_id:08x}")
        verified.append((candidates[0], sig))
    if not verified:
        raise NoteError("note has no verifiable signatures: " + ", ".join(
            f"{s.name}+{s.key_id:08x}" for s in note.signatures) + " are not the keys pinned")
    return Opened(note, tuple(verified), tuple(unverified))


def sign(text: str, signers: Sequence[Signer], *, existing: Sequence[Signature] = (), timestamp: int | None = None) -> str:
    """Go's note.Sign: the existing signatures first (less those the signers replace), then new ones."""
    if not text.endswith("\n") or not _no_controls(text):
        raise NoteError("a note's text ends with a newline and holds no other control character")
    fresh = [s.sign(text, timestamp=timestamp) for s in signers]
    replaced = {(s.name, s.key_id) for s in fresh}
    kept = [s for s in existing if (s.name, s.key_id) not in replaced]
    return Note(text, (*kept, *fresh)).encode()


@dataclass(frozen=True)
class Checkpoint:
    """A log's tree head as c2sp.org/tlog-checkpoint writes it."""

    origin: str
    size: int
    root_hash: bytes
    extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.origin or "\n" in self.origin or not _no_controls(self.origin):
            raise NoteError("a checkpoint's origin is one non-empty line")
        if self.size < 0:
            raise NoteError(f"a tree size is not negative; found {self.size}")
        if len(self.root_hash) != 32:
            raise NoteError(f"a root hash has 32 bytes, not {len(self.root_hash)}")
        if any(not e or "\n" in e for e in self.extensions):
            raise NoteError("extension lines are non-empty single lines")

    def body(self) -> str:
        return "".join(f"{line}\n" for line in (self.origin, str(self.size), _b64(self.root_hash), *self.extensions))

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        if not text.endswith("\n"):
            raise NoteError("a checkpoint's text ends with a newline")
        lines = text[:-1].split("\n")
        if len(lines) < 3:
            raise NoteError("a checkpoint has an origin, a tree size and a root hash")
        origin, size, root, *extensions = lines
        if not _DECIMAL.match(size):
            raise NoteError(f"a checkpoint's tree size is a decimal without leading zeros; found {size[:24]!r}")
        return cls(origin, int(size), _b64decode(root), tuple(extensions))


@dataclass(frozen=True)
class SignedCheckpoint:
    checkpoint: Checkpoint
    opened: Opened

    @property
    def text(self) -> str:
        return self.opened.note.encode()


def open_checkpoint(message: str | bytes, log_key: VerifierKey, *, also: Sequence[VerifierKey] = ()) -> SignedCheckpoint:
    """A checkpoint the log's key signed (its key name the origin, as the spec asks of logs), with
    any cosignatures by the keys in `also` verified too; NoteError otherwise."""
    opened = open_note(message, [log_key, *also])
    if opened.by(log_key) is None:
        raise NoteError(f"the checkpoint is not signed by the log's key {log_key.name}+{log_key.key_id:08x}")
    checkpoint = Checkpoint.parse(opened.note.text)
    if checkpoint.origin != log_key.name:
        raise NoteError(f"the checkpoint's origin {checkpoint.origin!r} is not the log key's name {log_key.name!r}")
    return SignedCheckpoint(checkpoint, opened)
