"""Plan mode and the silo's filter through the real app: R1 declared as a plan is priced by
dp-accounting's PLD accountant (2.3817), its rounds are approved, a deviating charge is refused, and
the filter and plan are in the silo's record, its history and its hash chain."""

from __future__ import annotations

import functools
import json

import pytest
from dp_accounting import dp_event as de
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from sqlalchemy import create_engine, text

from tests.conftest import ADMIN
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon

R1_STEP = {"type": "dpsgd", "batch_size": 256, "noise_multiplier": 1.1, "steps": 1}
R1_PLAN = {**R1_STEP, "steps": 14_062}
Q = 256 / 60_000


@functools.cache
def pld_oracle(steps: int) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(1.1)), steps))
    return float(accountant.get_epsilon(1e-5))


def charge(client, silo, key: str, mechanism):  # type: ignore[no-untyped-def]
    body = {"mechanism": mechanism, "idempotency_key": key}
    return client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers)


def test_r1_as_a_plan_is_priced_2_3817_approved_in_order_and_a_deviation_is_refused(client, make_silo) -> None:
    silo = make_silo(epsilon=2.40, dataset_size=60_000, horizon=R1_STEP)
    # Under the RDP filter alone the same budget would not cover R1 (2.61 there):
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    assert proven_epsilon(filter_of(detail), dpsgd_curve([(Q, 1.1, 14_062)]), delta=1e-5) > silo.epsilon

    declared = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": R1_PLAN}, headers=silo.headers)

    assert declared.status_code == 201, declared.text
    plan = declared.json()
    assert plan["epsilon"] == pytest.approx(2.3817, abs=1e-3)
    assert plan["epsilon"] == pytest.approx(pld_oracle(14_062), rel=1e-9)
    assert plan["units"] == 14_062 and plan["units_used"] == 0 and plan["after"] == "closed"

    first = charge(client, silo, "r0", R1_STEP)
    assert first.status_code == 201, first.text
    assert first.json()["epsilon_spent"] == pytest.approx(plan["epsilon"], rel=1e-12)
    bulk = charge(client, silo, "r1", {**R1_STEP, "steps": 14_000})
    assert bulk.status_code == 201, bulk.text

    entries = len(client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json())
    for key, mechanism, reason in [
        ("noisier", {**R1_STEP, "noise_multiplier": 1.0}, "departs from the silo's declared plan"),
        ("bigger-batch", {**R1_STEP, "batch_size": 512}, "departs from the silo's declared plan"),
        ("too-many", {**R1_STEP, "steps": 62}, "61 left"),
        ("other-kind", {"type": "gaussian", "noise_multiplier": 50.0}, "departs from the silo's declared plan"),
    ]:
        refused = charge(client, silo, key, mechanism)
        assert refused.status_code == 409, (key, refused.text)
        assert reason in refused.json()["detail"], refused.text
    assert len(client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()) == entries  # refusals write nothing

    assert charge(client, silo, "rest", {**R1_STEP, "steps": 61}).status_code == 201
    done = charge(client, silo, "after", R1_STEP)
    assert done.status_code == 409 and "all used" in done.json()["detail"]

    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    assert detail["gated_on"] == "plan"
    assert detail["plan"]["units_used"] == 14_062
    assert detail["epsilon_spent"] == pytest.approx(plan["epsilon"], rel=1e-12)
    assert detail["epsilon_remaining"] == 0.0
    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    assert [e["event"] for e in history[:2]] == ["create", "plan"]
    assert history[1]["subject"]["plan"]["epsilon"] == plan["epsilon"]
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


def test_stopping_early_is_free_and_a_plan_comes_before_any_charge_once(client, make_silo) -> None:
    silo = make_silo(epsilon=2.0, dataset_size=60_000, horizon=None)
    plan = {**R1_STEP, "steps": 3_000}
    assert client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": plan}, headers=ADMIN).status_code == 201
    again = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": plan}, headers=silo.headers)
    assert again.status_code == 409 and "fixed once" in again.json()["detail"]
    assert charge(client, silo, "a", {**R1_STEP, "steps": 10}).status_code == 201
    # Stopping here costs the plan's ε, never more, whatever the silo does next.
    assert client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()["epsilon_spent"] == pytest.approx(pld_oracle(3_000), rel=1e-9)

    charged = make_silo(epsilon=2.0, dataset_size=60_000)
    assert charge(client, charged, "a", R1_STEP).status_code == 201
    late = client.post(f"/v1/silos/{charged.id}/plan", json={"mechanism": plan}, headers=charged.headers)
    assert late.status_code == 409 and "before the first charge" in late.json()["detail"]

    small = make_silo(epsilon=1.0, dataset_size=60_000)
    over = client.post(f"/v1/silos/{small.id}/plan", json={"mechanism": R1_PLAN}, headers=small.headers)
    assert over.status_code == 409
    assert over.json()["epsilon_if_approved"] == pytest.approx(pld_oracle(14_062), rel=1e-9)
    assert client.get(f"/v1/silos/{small.id}", headers=ADMIN).json()["plan"] is None

    other = make_silo()
    # Another silo's key: refused, and told nothing about this silo (the service answers 404 there).
    assert client.post(f"/v1/silos/{small.id}/plan", json={"mechanism": plan}, headers=other.headers).status_code in (403, 404)
    unpriceable = client.post(f"/v1/silos/{small.id}/plan", json={"mechanism": {"type": "zcdp", "rho": 0.01}}, headers=ADMIN)
    assert unpriceable.status_code == 422 and unpriceable.json()["detail"][0]["loc"] == ["body", "mechanism"]


def test_the_filter_is_in_the_record_the_create_entry_and_the_hash_chain(client, make_silo, database_url: str) -> None:
    # The horizon declared is the default one's step (q = 256/60000, σ 1): one order holds 0.99 of δ.
    silo = make_silo(epsilon=2.6, dataset_size=60_000, horizon={**R1_STEP, "noise_multiplier": 1.0})
    detail = client.get(f"/v1/silos/{silo.id}", headers=silo.headers).json()
    assert detail["gated_on"] == "rdp_filter"
    assert detail["filter"]["orders"][0] == 9.1 and detail["filter"]["weights"][0] == pytest.approx(0.99, rel=1e-9)
    assert sum(detail["filter"]["weights"]) == pytest.approx(1.0)
    history = client.get(f"/v1/silos/{silo.id}/history", headers=silo.headers).json()
    assert history[0]["event"] == "create" and history[0]["subject"]["filter"]["orders"] == detail["filter"]["orders"]

    engine = create_engine(database_url)
    with engine.begin() as connection:
        stored = connection.execute(text("SELECT filter_spec FROM silos WHERE id = :i"), {"i": silo.id}).scalar_one()
        edited = json.dumps({**json.loads(stored), "orders": [32.0, 4.0, 5.9, 12.0, 16.0]})
        connection.execute(text("UPDATE silos SET filter_spec = :f WHERE id = :i"), {"f": edited, "i": silo.id})
    report = client.get("/v1/audit/verify", headers=ADMIN).json()
    assert report["ok"] is False and report["first_bad_silo_id"] == silo.id and report["first_bad_seq"] == 1
    with engine.begin() as connection:
        connection.execute(text("UPDATE silos SET filter_spec = :f WHERE id = :i"), {"f": stored, "i": silo.id})
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
    engine.dispose()


def test_quote_shows_the_proven_rdp_epsilon_the_plan_epsilon_and_the_gate(client, make_silo) -> None:
    silo = make_silo(epsilon=3.0, dataset_size=60_000, horizon=R1_STEP)
    body = {"mechanism": R1_PLAN, "silo_id": silo.id}
    quote = client.post("/v1/quote", json=body, headers=silo.headers).json()
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    proven = proven_epsilon(filter_of(detail), dpsgd_curve([(Q, 1.1, 14_062)]), delta=1e-5)
    assert quote["epsilon_rdp_proven"] == pytest.approx(proven, rel=1e-9)
    assert quote["epsilon_if_approved"] == pytest.approx(proven, rel=1e-9)
    assert quote["epsilon_plan"] == pytest.approx(pld_oracle(14_062), rel=1e-9)
    assert quote["gated_on"] == "rdp_filter"
    accountant = rdp_lib.RdpAccountant()
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(1.1)), 14_062))
    assert quote["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)  # the old field, as before

    assert charge(client, silo, "a", R1_STEP).status_code == 201
    later = client.post("/v1/quote", json=body, headers=silo.headers).json()
    assert later["epsilon_plan"] is None and "before the first" in later["plan_note"]

    planned = make_silo(epsilon=3.0, dataset_size=60_000, horizon=None)
    client.post(f"/v1/silos/{planned.id}/plan", json={"mechanism": R1_PLAN}, headers=ADMIN)
    on_plan = client.post("/v1/quote", json={"mechanism": R1_STEP, "silo_id": planned.id}, headers=ADMIN).json()
    assert on_plan["gated_on"] == "plan" and on_plan["epsilon_plan"] is None

    no_silo = client.post("/v1/quote", json={"mechanism": R1_PLAN | {"batch_size": None, "sampling_rate": Q},
                                             "delta": 1e-5}, headers=ADMIN).json()
    assert no_silo["gated_on"] is None
    assert no_silo["epsilon_plan"] == pytest.approx(pld_oracle(14_062), rel=1e-9)
    assert no_silo["epsilon"] < no_silo["epsilon_rdp_proven"] < no_silo["epsilon"] * 1.01
