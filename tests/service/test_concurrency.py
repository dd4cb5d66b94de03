"""Racing approvals over real HTTP (uvicorn on 127.0.0.1 with several workers): a silo whose budget
admits exactly k charges (by its published filter, tests/gate_oracle.py) gets exactly k, whatever
the interleaving, retries included."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from dp_accounting import dp_event as de
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.harness import running_server
from tests.conftest import ADMIN_KEY
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon

STEP = {"type": "dpsgd", "batch_size": 20, "noise_multiplier": 1.0, "steps": 1}  # dataset 1000 → q = 0.02
K = 37
REQUESTS = 200
CLIENTS = 32


def epsilon_of(rounds: int) -> float:
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.02, de.GaussianDpEvent(1.0)), rounds))
    return accountant.get_epsilon(1e-5)


def workers_for(url: str) -> int:
    return 4 if url.startswith("postgresql") else 2


@pytest.mark.parametrize("sent", [1, 2], ids=["once", "twice"])
def test_exactly_k_of_200_racing_requests_are_approved(database_url: str, sent: int) -> None:
    with running_server(database_url=database_url, admin_key=ADMIN_KEY, workers=workers_for(database_url)) as url:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        silo = httpx.post(
            f"{url}/v1/silos", headers=admin,
            json={"name": "racing", "epsilon": epsilon_of(K), "delta": 1e-5, "dataset_size": 1000, "horizon": STEP},
        ).json()
        headers = {"Authorization": f"Bearer {silo['api_key']}"}
        detail = httpx.get(f"{url}/v1/silos/{silo['id']}", headers=admin).json()
        fits = [r for r in range(1, 2 * K) if proven_epsilon(filter_of(detail), dpsgd_curve([(0.02, 1.0, r)]), delta=1e-5)
                <= silo["epsilon"] * (1 + 1e-9)]
        k = max(fits)
        assert k >= K // 2  # the filter's union bound costs a few rounds of the old rule's K, not most of them
        keys = [f"req-{i}" for i in range(REQUESTS)] * sent
        random.Random(7).shuffle(keys)

        with httpx.Client(base_url=url, headers=headers, timeout=60, limits=httpx.Limits(max_connections=CLIENTS)) as client:
            def ask(key: str) -> tuple[str, int, int | None]:
                response = client.post(f"/v1/silos/{silo['id']}/charges", json={"mechanism": STEP, "idempotency_key": key})
                assert response.status_code in (200, 201, 409), response.text
                return key, response.status_code, response.json().get("charge_id")

            with ThreadPoolExecutor(CLIENTS) as pool:
                answers = list(pool.map(ask, keys))

        approved = {charge_id for _, status, charge_id in answers if status == 201}
        assert len(approved) == k
        assert {charge_id for _, status, charge_id in answers if status == 200} <= approved  # replays name approvals
        by_key: dict[str, list[tuple[int, int | None]]] = {}
        for key, status, charge_id in answers:
            by_key.setdefault(key, []).append((status, charge_id))
        for outcomes in by_key.values():  # a retry names the first answer's charge, and only one is fresh
            assert len({charge_id for _, charge_id in outcomes}) == 1
            assert sum(status == 201 for status, _ in outcomes) <= 1

        detail = httpx.get(f"{url}/v1/silos/{silo['id']}", headers=admin).json()
        expected = proven_epsilon(filter_of(detail), dpsgd_curve([(0.02, 1.0, k)]), delta=1e-5)
        assert detail["epsilon_spent"] == pytest.approx(expected, rel=1e-9)
        assert detail["epsilon_spent"] <= silo["epsilon"] * (1 + 1e-9)
        history = httpx.get(f"{url}/v1/silos/{silo['id']}/history", headers=admin).json()
        assert [e["event"] for e in history].count("reserve") == k
        assert httpx.get(f"{url}/v1/audit/verify", headers=admin).json()["ok"] is True
