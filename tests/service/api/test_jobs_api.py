"""Jobs, norm reports and privacy groups: the coordinator groups silos without seeing a budget."""

from __future__ import annotations

import pytest

from tests.conftest import ADMIN, bearer


@pytest.fixture
def coordinator(client) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return bearer(client.post("/v1/keys", json={"role": "coordinator"}, headers=ADMIN).json()["api_key"])


def start_job(client, coordinator, silos) -> int:  # type: ignore[no-untyped-def]
    response = client.post("/v1/jobs", json={"name": "warm-start", "silo_ids": [s.id for s in silos]}, headers=coordinator)
    assert response.status_code == 201
    return int(response.json()["job_id"])


def report(client, job_id: int, round: int, silo, norm: float):  # type: ignore[no-untyped-def]
    return client.post(
        f"/v1/jobs/{job_id}/rounds/{round}/norms", json={"silo_id": silo.id, "l2_norm": norm}, headers=silo.headers
    )


NORMS = [0.9, 1.0, 1.1, 0.95, 1.05, 9.0, 10.0, 11.0]


def groups_for(client, coordinator, make_silo, budgets: list[float]) -> dict:  # type: ignore[no-untyped-def]
    silos = [make_silo(epsilon=b) for b in budgets]
    job_id = start_job(client, coordinator, silos)
    for silo, norm in zip(silos, NORMS, strict=True):
        assert report(client, job_id, 0, silo, norm).status_code == 201
    response = client.get(f"/v1/jobs/{job_id}/rounds/0/groups", headers=coordinator)
    assert response.status_code == 200
    body = response.json()
    # Renumber by position so two jobs with different silo ids compare.
    order = [s.id for s in silos]
    return {"by_position": [body["groups"][str(i)] for i in order], "components": body["components"], "n": body["n_components"]}


def test_groups_are_numbered_by_increasing_norm(client, coordinator, make_silo) -> None:
    result = groups_for(client, coordinator, make_silo, [1.0] * len(NORMS))
    assert result["n"] == 2
    assert result["by_position"] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert result["components"][0]["size"] == 5 and result["components"][1]["size"] == 3
    assert result["components"][0]["mean_norm"] == pytest.approx(1.0, rel=1e-9)
    assert result["components"][1]["mean_norm"] == pytest.approx(10.0, rel=1e-9)


def test_the_same_norms_give_the_same_groups_whatever_the_budgets(client, coordinator, make_silo) -> None:
    generous = groups_for(client, coordinator, make_silo, [100.0] * len(NORMS))
    mixed = groups_for(client, coordinator, make_silo, [0.1, 5.0, 0.3, 9.0, 0.2, 0.1, 7.0, 1.0])
    assert generous == mixed


def test_fewer_than_three_reports_make_one_group(client, coordinator, make_silo) -> None:
    silos = [make_silo(), make_silo()]
    job_id = start_job(client, coordinator, silos)
    report(client, job_id, 0, silos[0], 1.0)
    report(client, job_id, 0, silos[1], 50.0)
    body = client.get(f"/v1/jobs/{job_id}/rounds/0/groups", headers=coordinator).json()
    assert body["n_components"] == 1 and set(body["groups"].values()) == {0}


def test_one_report_per_silo_and_round(client, coordinator, make_silo) -> None:
    silo, outsider = make_silo(), make_silo()
    job_id = start_job(client, coordinator, [silo])
    assert report(client, job_id, 3, silo, 2.5).status_code == 201
    assert report(client, job_id, 3, silo, 2.5).status_code == 201  # a retry of the same report
    second = report(client, job_id, 3, silo, 2.6)
    assert second.status_code == 409 and "already reported 2.5" in second.json()["detail"]
    not_member = report(client, job_id, 3, outsider, 1.0)
    # A job the silo is not part of is not its to see: the same 404 as a job that does not exist.
    assert not_member.status_code == 404 and not_member.json() == {"detail": f"job {job_id} not found"}
    negative = report(client, job_id, 4, silo, -1.0)
    assert negative.status_code == 422 and negative.json()["detail"][0]["loc"] == ["body", "l2_norm"]
    assert client.post("/v1/jobs", json={"name": "x", "silo_ids": [999]}, headers=coordinator).status_code == 422


def test_a_silo_registers_by_choosing_a_level_of_the_menu(client) -> None:
    for name, eps in (("strict", 0.5), ("standard", 2.0)):
        assert client.post("/v1/levels", json={"name": name, "epsilon": eps, "delta": 1e-6}, headers=ADMIN).status_code == 201
    assert [lv["name"] for lv in client.get("/v1/levels", headers=ADMIN).json()] == ["strict", "standard"]

    created = client.post("/v1/silos", json={"name": "school", "level": "strict", "dataset_size": 300}, headers=ADMIN)

    assert created.status_code == 201
    assert (created.json()["epsilon"], created.json()["delta"]) == (0.5, 1e-6)
    unknown = client.post("/v1/silos", json={"name": "bank", "level": "lavish", "dataset_size": 3}, headers=ADMIN)
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "level"]
    both = client.post(
        "/v1/silos", json={"name": "b", "level": "strict", "epsilon": 1, "delta": 1e-5, "dataset_size": 3}, headers=ADMIN
    )
    assert both.status_code == 422 and "either level or" in both.json()["detail"][0]["msg"]
