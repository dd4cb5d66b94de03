"""The leaf record's bytes are fixed forever (stored leaf hashes depend on them): the text a page of
the log splices together must be exactly the canonical JSON of the whole record."""

from __future__ import annotations

import hashlib
import json
import math
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from dpledger.service.ledger import chain
from dpledger.service.ledger.transparency import leaf_record


def whole(entry: Any, subject: dict[str, Any], salt: str) -> str:
    epsilon = entry.epsilon_spent
    body = {"v": 1, "salt": salt, "subject": subject, "entry": {
        "silo_id": entry.silo_id, "seq": entry.seq, "event": entry.event, "charge_id": entry.charge_id,
        "epsilon_spent": epsilon if math.isfinite(epsilon) else None, "created_at": chain.timestamp(entry.created_at),
        "prev_hash": entry.prev_hash, "hash": entry.hash}}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("epsilon", [0.0, 1.25, math.inf])
@pytest.mark.parametrize("subject", [
    {},
    {"id": 7, "rdp": json.dumps([0.1, math.inf, 3e-300]), "mechanism": '{"type":"dpsgd"}', "job_id": None, "round": 3},
    {"name": "Hôpital \"Nord\"\n", "epsilon": 3.0, "filter": "{\"orders\":[2.0]}", "zeta": [1, {"b": 2, "a": 1}]},
])
def test_the_spliced_record_is_the_canonical_json_of_the_whole(epsilon: float, subject: dict[str, Any]) -> None:
    entry = SimpleNamespace(silo_id=3, seq=12, event="reserve", charge_id=None, epsilon_spent=epsilon,
                            created_at=datetime(2026, 11, 27, 13, 0, 0, 123456, tzinfo=UTC), prev_hash="a" * 64, hash="b" * 64)
    assert leaf_record(entry, subject=subject, salt="0f" * 16) == whole(entry, subject, "0f" * 16)


@pytest.mark.parametrize("epsilon", [0.0, 1.25, math.inf])
@pytest.mark.parametrize("subject", [
    {},
    {"id": 7, "rdp": json.dumps([0.1, math.inf, 3e-300]), "mechanism": '{"type":"dpsgd"}', "job_id": None, "round": 3},
    {"name": "Hôpital \"Nord\"\n", "epsilon": 3.0, "filter": "{\"orders\":[2.0]}", "zeta": [1, {"b": 2, "a": 1}]},
])
def test_the_chain_hash_with_the_subject_spliced_in_is_the_hash_of_the_whole_payload(
    epsilon: float, subject: dict[str, Any],
) -> None:
    # Stored chain hashes depend on these bytes: the subject's text, spliced in last, must give the
    # hash of the canonical JSON of the whole payload, whether the caller passes the subject or its text.
    entry = SimpleNamespace(silo_id=3, seq=12, event="reserve", charge_id=None, epsilon_spent=epsilon,
                            created_at=datetime(2026, 11, 27, 13, 0, 0, 123456, tzinfo=UTC), prev_hash="a" * 64, hash="")
    payload = {"silo_id": 3, "seq": 12, "event": "reserve", "charge_id": None, "epsilon_spent": epsilon,
               "created_at": "2026-11-27T13:00:00.123456", "prev_hash": "a" * 64, "subject": subject}
    expected = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert chain.entry_hash(entry, subject=subject) == expected
    assert chain.entry_hash(entry, subject_text=chain.canonical(subject)) == expected
