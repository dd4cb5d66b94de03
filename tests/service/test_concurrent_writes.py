"""Issue 12: every write goes through the ledger's one write transaction, so writers that meet on
SQLite queue instead of failing. Many threads, against a real server with two worker processes,
report norms and create keys at once: every request succeeds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from dpledger.harness import running_server
from tests.conftest import ADMIN_KEY

THREADS = 16
ROUNDS = 4


def test_many_threads_report_norms_and_create_keys_at_once_on_sqlite(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with running_server(database_url=url, admin_key=ADMIN_KEY, workers=2) as base, httpx.Client(
        base_url=base, timeout=60, limits=httpx.Limits(max_connections=THREADS)
    ) as client:
        silos = [
            client.post("/v1/silos", headers=admin, json={"name": f"s{i}", "epsilon": 1.0, "delta": 1e-5, "dataset_size": 100})
            .json()
            for i in range(THREADS // 2)
        ]
        job = client.post("/v1/jobs", headers=admin, json={"name": "j", "silo_ids": [s["id"] for s in silos]}).json()["job_id"]

        def report(silo: dict) -> list[int]:
            headers = {"Authorization": f"Bearer {silo['api_key']}"}
            return [
                client.post(f"/v1/jobs/{job}/rounds/{r}/norms", headers=headers, json={"silo_id": silo["id"], "l2_norm": 1.0 + r})
                .status_code
                for r in range(ROUNDS)
            ]

        def create_keys(_: int) -> list[int]:
            return [client.post("/v1/keys", headers=admin, json={"role": "auditor"}).status_code for _ in range(ROUNDS)]

        with ThreadPoolExecutor(THREADS) as pool:
            # Both kinds at once, then every norm again (a retry of the same value is answered 201):
            # reads-then-writes of both kinds interleave on the one database.
            futures = [pool.submit(report, s) for s in silos] + [pool.submit(create_keys, i) for i in range(THREADS // 2)]
            futures += [pool.submit(report, s) for s in silos]
            answers = [f.result() for f in futures]

        assert all(code == 201 for codes in answers for code in codes), answers
        groups = client.get(f"/v1/jobs/{job}/rounds/0/groups", headers=admin).json()
        assert set(groups["groups"]) == {str(s["id"]) for s in silos}
