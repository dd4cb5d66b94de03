"""dpledger.wire.note against the ecosystem's own bytes: Go's golang.org/x/mod/sumdb/note test vectors
(its note_test.go: the PeterNeumann and EnochRoot keys and their signed text), transparency-dev's
cosignature vectors (a native 0x04 witness key, a cosignature's time), and a real checkpoint of a
static Certificate Transparency log, signed by the log's note key and cosigned by a public witness."""

from __future__ import annotations

import base64
import hashlib

import pytest

from dpledger.wire import note
from dpledger.wire.note import (
    COSIGNATURE_V1,
    ED25519,
    Checkpoint,
    NoteError,
    Signature,
    Signer,
    VerifierKey,
    open_checkpoint,
    open_note,
)

PETER_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
PETER_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
PETER_SIG = "— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
ENOCH_SIG = "— EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox33WWd1RvMc+QQ=\n"

# A checkpoint of the static CT log arche2025h1.staging.ct.transparency.dev: an RFC 6962 STH signature
# (type 0x05, unknown here), the log's Ed25519 note signature, and four witnesses' cosignatures.
ARCHE = """arche2025h1.staging.ct.transparency.dev
1432088532
U7WM79jrzyhGZ5/GUBTpM7NzwdyfFx61t3RovgcC4Ro=

— arche2025h1.staging.ct.transparency.dev zTM8sQAAAZ5W0WdjBAMARjBEAiBjW5IQf9pvsYLfQFX6hoGREPMHbdQ3urbllzalApkptQIgIpwtEroeW2BXaHAI4kJXFbon5Ch9MNL5zRNZ55lvGt0=
— arche2025h1.staging.ct.transparency.dev ui8GwCF1+kWqZrxGdhj4aX3gcw7XUlXQQabg/27lefwhUkzbC3NygNI75MdhL1bfTW9g8Ei59RA23oHP7Ry1k3ZFWwQ=
— transparency.dev/DEV:witness-little-garden 2AQqhwAAAABqEiEgzgFIqqhbUoDwjMWE6UP8nd8/KYTzwZ2rhIgcqoXHAwVkjZr4AscylP3v7sEodkRAErumC2q44vdgJY096st5BQ==
— witness1.smartit.nu/witness1 pIyCDwAAAABqEiEghIp82KWebrw7/oHQwlTAm3g2RKS4+eebl8eO0WH+/iEcxZ75W3u5hNI7TOQtmJbqmNWVuE0tgh0XwzdZsDsUAQ==
— remora.n621.de 2net5wAAAABqEiEgPlfF3V06o0Y+fHM+J5J9s27wgxxcOVSpZ/2g/KSiXCg9DEZI+aVCIobWX9sXTynk5XeU/zZ0WBxtqB0DrAWfBw==
— witness.stagemole.eu Z/euoAAAAABqEiEgw0i+7g2ENfDAWHmtRzCfKTHSDwYDJA2NmKeGi9Y8FtEyOUvVr+AJmIY/2TUFucgKi7lI7cUiOvKFYe/TmN9DAg==
"""  # noqa: E501 (the published lines, verbatim)
ARCHE_LOG = "arche2025h1.staging.ct.transparency.dev+ba2f06c0+AU0vHmlGCS/PdN8b2OaGmKprLI8HKM+dJ472xgFYh15f"
REMORA = "remora.n621.de+da77ade7+BOvN63jn/bLvkieywe8R6UYAtVtNbZpXh34x7onlmtw2"


def test_go_verifier_keys_parse_and_print_back_and_every_mangling_is_refused() -> None:
    key = VerifierKey.parse(PETER_VKEY)
    assert (key.name, key.signature_type, f"{key.key_id:08x}") == ("PeterNeumann", ED25519, "c74f20a3")
    assert key.encode() == PETER_VKEY
    # The key ID is SHA-256(name || 0x0A || 0x01 || key)[:4], computed here without the module.
    assert hashlib.sha256(b"PeterNeumann\n\x01" + key.public_key).hexdigest()[:8] == "c74f20a3"
    raw = PETER_VKEY.encode()
    for i in range(len(raw) + 1):  # Go's TestNewVerifier: every proper substring, every byte bumped by one
        for j in range(i + 1, len(raw) + 1):
            if (i, j) != (0, len(raw)):
                with pytest.raises(NoteError):
                    VerifierKey.parse(raw[i:j].decode())
    for i in range(len(raw)):
        bumped = bytearray(raw)
        bumped[i] += 1
        with pytest.raises(NoteError):
            VerifierKey.parse(bumped.decode())
    with pytest.raises(NoteError):  # wrong key length, key ID adjusted
        VerifierKey.parse("PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY==")
    with pytest.raises(NoteError):  # unknown algorithm, key ID adjusted
        VerifierKey.parse("PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW")


def test_the_go_signer_key_signs_the_very_note_go_prints() -> None:
    signer = Signer.parse(PETER_SKEY)
    assert signer.verifier.encode() == PETER_VKEY
    assert signer.encode() == PETER_SKEY
    assert note.sign(TEXT, [signer]) == TEXT + "\n" + PETER_SIG
    # An existing signature of the same key is replaced, not repeated (Go's TestSign).
    stale = Signature("PeterNeumann", 0xC74F20A3, b"BAD")
    assert note.sign(TEXT, [signer], existing=[stale]) == TEXT + "\n" + PETER_SIG
    with pytest.raises(NoteError):
        note.sign("abc", [signer])


def test_open_follows_gos_rules_for_known_unknown_repeated_and_broken_signatures() -> None:
    peter, enoch = VerifierKey.parse(PETER_VKEY), VerifierKey.parse(ENOCH_VKEY)
    opened = open_note(TEXT + "\n" + PETER_SIG + ENOCH_SIG, [peter])
    assert opened.note.text == TEXT
    assert [k for k, _ in opened.verified] == [peter]
    assert [(s.name, s.key_id) for s in opened.unverified] == [("EnochRoot", 0xAF0CFE78)]
    both = open_note(TEXT + "\n" + PETER_SIG + ENOCH_SIG, [peter, enoch])
    assert [k for k, _ in both.verified] == [peter, enoch]
    with pytest.raises(NoteError, match="no verifiable signatures"):
        open_note(TEXT + "\n" + PETER_SIG + ENOCH_SIG, [])
    with pytest.raises(NoteError, match="ambiguous key EnochRoot"):
        open_note(TEXT + "\n" + ENOCH_SIG, [enoch, peter, _same_id_other_key(enoch)])
    with pytest.raises(NoteError, match="more than 100"):
        open_note(TEXT + "\n" + PETER_SIG * 101, [peter])
    tampered = PETER_SIG.encode()
    broken = (tampered[:60] + b"ABCD" + tampered[60:]).decode()
    with pytest.raises(NoteError, match="invalid signature for key PeterNeumann\\+c74f20a3"):
        open_note(TEXT + "\n" + broken, [peter])
    enoch_broken = (ENOCH_SIG.encode()[:60] + b"ABCD" + ENOCH_SIG.encode()[60:]).decode()
    repeated = open_note(TEXT + "\n" + PETER_SIG + PETER_SIG + ENOCH_SIG + ENOCH_SIG + enoch_broken, [peter])
    assert [k for k, _ in repeated.verified] == [peter]
    assert len(repeated.unverified) == 2  # the repeated unknown line once, the altered one kept as another
    for bad in (TEXT, TEXT + "\n", TEXT + "\n" + PETER_SIG[:-1], "\x01" + TEXT + "\n" + PETER_SIG,
                TEXT + "\n" + PETER_SIG.replace("PeterNeumann", "Bad Name")[:-1],
                TEXT + "\n" + PETER_SIG + "Unexpected line.\n"):
        with pytest.raises(NoteError):
            open_note(bad, [peter])
    with pytest.raises(NoteError):
        open_note(b"\xff" + (TEXT + "\n" + PETER_SIG).encode(), [peter])


def _same_id_other_key(key: VerifierKey) -> VerifierKey:
    """A verifier key list that holds two entries for one (name, ID): Go reports it as ambiguous."""
    class Twin(VerifierKey):
        @property
        def key_id(self) -> int:
            return key.key_id

    return Twin(key.name, ED25519, bytes(32))


def test_a_real_static_ct_checkpoint_verifies_with_its_log_key_and_its_witness_cosignature() -> None:
    log_key = VerifierKey.parse(ARCHE_LOG)
    remora = VerifierKey.parse(REMORA)
    assert remora.signature_type == COSIGNATURE_V1 and remora.encode() == REMORA
    signed = open_checkpoint(ARCHE, log_key, also=[remora])
    assert signed.checkpoint == Checkpoint("arche2025h1.staging.ct.transparency.dev", 1432088532,
                                           base64.b64decode("U7WM79jrzyhGZ5/GUBTpM7NzwdyfFx61t3RovgcC4Ro="))
    cosig = signed.opened.by(remora)
    assert cosig is not None
    assert cosig.timestamp == int.from_bytes(base64.b64decode("2net5wAAAABqEiEg")[4:12], "big")
    assert len(signed.opened.unverified) == 4  # the STH signature and three witnesses not pinned: ignored
    # The cosignature signs "cosignature/v1\ntime <t>\n" || the body: checked here with the raw key.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    Ed25519PublicKey.from_public_bytes(remora.public_key).verify(
        cosig.signature[8:], f"cosignature/v1\ntime {cosig.timestamp}\n".encode() + signed.checkpoint.body().encode())
    assert signed.checkpoint.body() + "\n" == ARCHE[: ARCHE.index("\n\n") + 2]
    # Another size under the same signatures: both the log's and the witness's fail.
    with pytest.raises(NoteError, match="invalid signature"):
        open_checkpoint(ARCHE.replace("1432088532", "42"), log_key)
    with pytest.raises(NoteError, match="invalid signature for key remora"):
        open_checkpoint(ARCHE.replace("1432088532", "42"), VerifierKey.parse(PETER_VKEY), also=[remora])
    # A 0x01 key given as a witness key is read as its cosigner (transparency-dev's conversion).
    test = VerifierKey.parse("TEST+7997405c+AQcC+FTVKf0jlTdHDY3rbevmnKxxPjigCXlVtGe6RIr6")
    assert test.as_cosigner().signature_type == COSIGNATURE_V1 and test.as_cosigner().key_id != test.key_id


def test_a_cosignature_time_reads_as_transparency_dev_reads_it() -> None:
    raw = base64.b64decode("ZGhGuQAAAABm/qTPeyKXD+R2rzyQsxPiP8mXum7qq/iF0u4vanlqJyocWODBt97w9uL+8qT7"
                           "S5gxEHWWOworDcFiEBYJXORmnFBOBA==")
    assert Signature("w", int.from_bytes(raw[:4], "big"), raw[4:]).timestamp == 1727964367
    plain = base64.b64decode("eQjRQm6eSKzFoiYalgwCPXu2y3ijtg68is9M46JKxuZB+dRfTmeQeDBoXnvxZx2ugnkyV+MUMLXpWs1hPb/W/4xkNQY=")
    with pytest.raises(NoteError):
        _ = Signature("w", 0, plain[4:]).timestamp


def test_checkpoints_we_sign_and_cosign_round_trip_and_refuse_any_other_encoding() -> None:
    log = Signer.generate("example.com/log")
    witness = Signer.generate("witness.example/w1", COSIGNATURE_V1)
    body = Checkpoint("example.com/log", 20852163, bytes(range(32))).body()
    assert body == f"example.com/log\n20852163\n{base64.b64encode(bytes(range(32))).decode()}\n"
    signed = note.sign(body, [log])
    cosigned = note.sign(body, [witness], existing=note.parse(signed).signatures, timestamp=1679315147)
    assert cosigned.startswith(signed)  # the log's line first, the cosignature after it
    opened = open_checkpoint(cosigned, log.verifier, also=[witness.verifier])
    cosig = opened.opened.by(witness.verifier)
    assert cosig is not None and cosig.timestamp == 1679315147
    assert Signer.parse(witness.encode()).verifier == witness.verifier
    for text in ("example.com/log\n020852163\nAAAA\n", "example.com/log\n-1\nAAAA\n", "\n1\nAAAA\n", "o\n1\n",
                 f"o\n1\n{base64.b64encode(bytes(31)).decode()}\n", f"o\n1\n{base64.b64encode(bytes(32)).decode()}\n\n"):
        with pytest.raises(NoteError):
            Checkpoint.parse(text)
    with pytest.raises(NoteError, match="origin"):
        open_checkpoint(note.sign(Checkpoint("other.example/log", 1, bytes(32)).body(), [log]), log.verifier)
