"""The approval's route reads a plainly valid request itself (service/api/direct.py) and leaves every
other one to FastAPI: held to answer exactly what FastAPI's own handler answers, on a seeded family
of bodies, paths and headers, the odd ones included."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pydantic import ValidationError

from dpledger.service.api.direct import JSON, parsed_body, parsed_id
from dpledger.wire.schemas import MAX_ID, ChargeRequest
from tests.conftest import ADMIN, TEST_HORIZON

MECHANISMS: list[Any] = [
    {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 1},
    {"type": "dpsgd", "sampling_rate": 0.01, "noise_multiplier": 2.5, "steps": 3},
    {"type": "gaussian", "noise_multiplier": 4.0},
    {"type": "self_composed", "count": 2, "event": {"type": "gaussian", "noise_multiplier": 8}},
    {"type": "poisson_sampled", "sampling_rate": 0.02, "event": {"type": "gaussian", "noise_multiplier": 3}},
]
# Values a field may be given instead of its own, each read differently by a lax or a strict parser.
ODD_VALUES = ["1", "1.5", 1.0, 1.5, True, None, 0, -1, 2**70, -0.0, 1e308, [], {}, "", "x" * 300, "é"]
# Texts FastAPI's json.loads and pydantic's JSON parser might read apart.
ODD_TEXTS = [
    '{"idempotency_key": "a", "idempotency_key": "b", "mechanism": %s}',  # a repeated key: the last one
    '{"idempotency_\\u006bey": "k", "mechanism": %s}',  # an escaped name
    '{"idempotency_key": "k\\ud800", "mechanism": %s}',  # a lone surrogate
    '{"idempotency_key": "k", "mechanism": %s, "round": 1e0}',
    '{"idempotency_key": "k", "mechanism": %s, "round": 10000000000000000000000}',
    '{"idempotency_key": "k", "mechanism": %s}  ',
    '{"idempotency_key": "k", "mechanism": %s} x',
    '\ufeff{"idempotency_key": "k", "mechanism": %s}',
    '[{"idempotency_key": "k", "mechanism": %s}]',
    '{"idempotency_key": "k", "mechanism": %s, "job_id": NaN}',
    '{"idempotency_key": "k", "mechanism": %s, "round": Infinity}',
]


def bodies(seed: int, count: int) -> list[bytes]:
    """A seeded family: valid requests, each field dropped, replaced by an odd value or joined by an
    unknown one, and the odd texts."""
    rng = random.Random(seed)
    out: list[bytes] = []
    for i in range(count):
        body: dict[str, Any] = {"idempotency_key": f"k{i}", "mechanism": json.loads(json.dumps(rng.choice(MECHANISMS)))}
        for field, value in (("job_id", "job"), ("round", rng.randrange(0, 50)), ("attempt_id", "a" * 32)):
            if rng.random() < 0.5:
                body[field] = value
        change = rng.random()
        if change < 0.25:
            target = rng.choice([body, body["mechanism"]])
            target[rng.choice(sorted(target))] = rng.choice(ODD_VALUES)
        elif change < 0.35:
            del body[rng.choice(sorted(body))]
        elif change < 0.45:
            body[rng.choice(["extra", "Mechanism", "idempotency-key"])] = 1
        elif change < 0.6:
            out.append((rng.choice(ODD_TEXTS) % json.dumps(body["mechanism"])).replace('"k"', f'"k{i}"').encode())
            continue
        out.append(json.dumps(body, indent=rng.choice([None, 2])).encode())
    return out


def fastapi_reads(body: bytes) -> ChargeRequest | None:
    """What FastAPI's handler makes of a JSON body: json.loads, then the model validates the value."""
    try:
        return ChargeRequest.model_validate(json.loads(body))
    except (ValueError, ValidationError):
        return None


@pytest.mark.parametrize("seed", range(4))
def test_a_body_read_directly_is_what_fastapi_reads(seed: int) -> None:
    family = bodies(seed, 300)
    direct = [parsed_body(ChargeRequest, body) for body in family]
    # The family reaches both sides: bodies read directly, and bodies left to FastAPI.
    assert sum(d is not None for d in direct) > 100 and sum(d is None for d in direct) > 50
    for body, read in zip(family, direct, strict=True):
        if read is not None:
            assert read == fastapi_reads(body), body


@pytest.mark.parametrize(("raw", "expected"), [
    ("7", 7), ("007", 7), (str(MAX_ID), MAX_ID), ("0", None), (str(MAX_ID + 1), None), ("-1", None), ("+1", None),
    (" 1", None), ("1.0", None), ("١", None), ("", None), (None, None),
])
def test_a_path_id_read_directly_is_fastapis(raw: object, expected: int | None) -> None:
    assert parsed_id(raw) == expected


def _comparable(response: Any) -> tuple[int, Any]:
    """A response without what differs between two silos by construction (ids, receipts)."""
    try:
        data = response.json()
    except ValueError:
        return response.status_code, response.text
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in ("charge_id", "receipt")}
        if isinstance(data.get("detail"), str):
            data["detail"] = data["detail"].replace(str(response.request.url).split("/")[5], "SILO")
    return response.status_code, data


def test_the_route_answers_as_fastapi_does(client, make_silo) -> None:
    """Twin silos get the same requests, one as a client sends them (read directly where plainly
    valid) and one with a content type only FastAPI reads: every answer alike, 201s, replays and 422s."""
    direct, standard = make_silo(epsilon=50.0, horizon=TEST_HORIZON), make_silo(epsilon=50.0, horizon=TEST_HORIZON)
    family = bodies(7, 60)
    family += family[:5]  # replays of the first keys
    statuses = set()
    for body in family:
        answers = [
            client.post(f"/v1/silos/{silo.id}/charges", content=body, headers={**silo.headers, "Content-Type": kind})
            for silo, kind in ((direct, JSON), (standard, "application/json; charset=utf-8"))
        ]
        one, other = (_comparable(a) for a in answers)
        assert one == other, body
        statuses.add(one[0])
    assert {200, 201, 422} <= statuses
    history = [client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json() for silo in (direct, standard)]
    assert history[0]["epsilon_spent"] == history[1]["epsilon_spent"] > 0
    valid = json.dumps({"idempotency_key": "other", "mechanism": MECHANISMS[0]}).encode()
    for headers in ({}, {"Authorization": "Basic x"}, {"Authorization": "Bearer"}, {"Authorization": "bearer  wrong"}):
        answers = [client.post(f"/v1/silos/{silo.id}/charges", content=valid, headers={**headers, "Content-Type": kind})
                   for silo, kind in ((direct, JSON), (standard, "application/json; charset=utf-8"))]
        assert _comparable(answers[0]) == _comparable(answers[1]) and answers[0].status_code == 401
    for path in ("0", "+1", f"00{direct.id}", str(MAX_ID + 1), "x"):  # FastAPI reads "+1" as silo 1
        answers = [client.post(f"/v1/silos/{path}/charges", headers={**direct.headers, "Content-Type": kind},
                               content=json.dumps({"idempotency_key": f"{path}-{kind}", "mechanism": MECHANISMS[0]}))
                   for kind in (JSON, "application/json; charset=utf-8")]
        assert answers[0].status_code == answers[1].status_code, path  # two charges of one silo where it is one
        assert answers[0].is_success or answers[0].json() == answers[1].json(), path
