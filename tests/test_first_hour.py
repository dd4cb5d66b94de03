"""What a new user met in the first hour (issue 45): a δ that cannot be a guarantee, a second server
on one ledger, a database file gone under a running server, a full disk, and the CLI's texts."""

from __future__ import annotations

import math

import pytest

from dpledger.wire.schemas import delta_refusal
from tests.conftest import ADMIN


@pytest.mark.parametrize(("delta", "size"), [(0.01, 674), (1 / 674, 674), (1e-5, 100_000), (0.5, 2)])
def test_delta_at_or_above_one_over_n_is_a_422_naming_delta_and_the_bound(client, delta, size) -> None:
    body = {"name": "hospital", "epsilon": 4.0, "delta": delta, "dataset_size": size}
    response = client.post("/v1/silos", json=body, headers=ADMIN)
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "delta"]
    assert f"1/dataset_size = 1/{size} = {1 / size:.3g}" in error["msg"]
    assert client.get("/v1/silos", headers=ADMIN).json() == []  # nothing written


def test_delta_just_below_one_over_n_is_accepted(client) -> None:
    # 1e-5 · 99_999 < 1: the largest set 1e-5 still suits.
    body = {"name": "hospital", "epsilon": 4.0, "delta": 1e-5, "dataset_size": 99_999}
    assert client.post("/v1/silos", json=body, headers=ADMIN).status_code == 201


def test_a_levels_delta_is_held_to_the_silos_size(client) -> None:
    assert client.post("/v1/levels", json={"name": "loose", "epsilon": 1.0, "delta": 1e-3}, headers=ADMIN).status_code == 201
    refused = client.post("/v1/silos", json={"name": "s", "level": "loose", "dataset_size": 5000}, headers=ADMIN)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "level"]
    assert "1/5000" in refused.json()["detail"][0]["msg"]
    fits = client.post("/v1/silos", json={"name": "s", "level": "loose", "dataset_size": 999}, headers=ADMIN)
    assert fits.status_code == 201


def test_the_suggested_delta_is_below_one_over_a_hundred_n() -> None:
    for size in (2, 674, 1797, 60_000, 10**9):
        said = delta_refusal(1.0 - 1e-9, size)
        assert said is not None
        suggested = float(said.rsplit("e.g. ", 1)[1].rstrip(")"))
        assert suggested <= min(1e-5, 1 / (100 * size))
        assert suggested == 1e-5 or suggested > 1 / (1000 * size)  # the largest such power of ten
        assert math.log10(suggested) == round(math.log10(suggested))  # a power of ten
