"""A plan beside the filter, and the silo's filter, through the real app: R1 declared as a plan is
priced by dp-accounting's PLD accountant on half of δ (2.48), its rounds are read at the lower of
that and the filter's reading, a charge off the plan ends the plan's branch (never the silo), and the
filter and plan are in the silo's record, its history and its hash chain."""

from __future__ import annotations

import functools
import json
import math

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
def pld_oracle(steps: int, delta: float = 1e-5) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(Q, de.GaussianDpEvent(1.1)), steps))
    return float(accountant.get_epsilon(delta))


def charge(client, silo, key: str, mechanism):  # type: ignore[no-untyped-def]
    body = {"mechanism": mechanism, "idempotency_key": key}
    return client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers)


def test_r1_as_a_plan_beside_the_filter_is_priced_on_half_of_delta_and_read_at_the_lower_of_the_two(client, make_silo) -> None:
    silo = make_silo(epsilon=2.6, dataset_size=60_000, horizon=R1_STEP)
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    # Under the RDP filter alone the same budget would not cover R1 (2.61 there on the whole δ):
    assert proven_epsilon(filter_of(detail), dpsgd_curve([(Q, 1.1, 14_062)]), delta=1e-5) > silo.epsilon

    declared = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": R1_PLAN}, headers=silo.headers)

    assert declared.status_code == 201, declared.text
    plan = declared.json()
    assert plan["epsilon"] == pytest.approx(pld_oracle(14_062, 0.5e-5), rel=1e-9)  # on its half of δ
    assert plan["epsilon"] == pytest.approx(2.48, abs=0.01)
    assert plan["units"] == 14_062 and plan["units_used"] == 0 and plan["after"] == "filter"
    assert plan["delta_share"] == 0.5 and plan["ended_at_seq"] is None
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    assert detail["gated_on"] == "plan_and_filter"
    # The filter served beside the plan holds the other half of δ: every share halved (one ulp down).
    alone = make_silo(epsilon=2.6, dataset_size=60_000, horizon=R1_STEP)
    unplanned = client.get(f"/v1/silos/{alone.id}", headers=ADMIN).json()["filter"]
    assert detail["filter"]["weights"] == [math.nextafter(w / 2, 0.0) for w in unplanned["weights"]]
    pairs = filter_of(detail)

    def gate(steps: int) -> float:  # the lower of the plan's ε and the filter's, every charge on the plan
        return min(plan["epsilon"], proven_epsilon(pairs, dpsgd_curve([(Q, 1.1, steps)]), delta=1e-5))

    first = charge(client, silo, "r0", R1_STEP)
    assert first.status_code == 201, first.text
    assert first.json()["epsilon_spent"] == pytest.approx(gate(1), rel=1e-9)
    assert gate(1) < plan["epsilon"] / 2  # early on, the filter's reading
    bulk = charge(client, silo, "r1", {**R1_STEP, "steps": 14_000})
    assert bulk.status_code == 201, bulk.text
    assert bulk.json()["epsilon_spent"] == pytest.approx(plan["epsilon"], rel=1e-12)  # the plan's, late

    # Off the plan: read by the filter alone, which cannot afford it here; the refusal writes nothing.
    entries = len(client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json())
    refused = charge(client, silo, "noisier", {**R1_STEP, "noise_multiplier": 1.0})
    assert refused.status_code == 409, refused.text
    off = dpsgd_curve([(Q, 1.1, 14_001), (Q, 1.0, 1)])
    assert refused.json()["epsilon_if_approved"] == pytest.approx(proven_epsilon(pairs, off, delta=1e-5), rel=1e-9)
    # Beside the gate's reading, labelled, dp-accounting's non-adaptive ε of the same charges (for reference).
    reference = float(rdp_lib.compute_epsilon(rdp_lib.DEFAULT_RDP_ORDERS, off, 1e-5)[0])
    assert refused.json()["epsilon_dp_accounting"] == pytest.approx(reference, rel=1e-9)
    assert reference < refused.json()["epsilon"] < refused.json()["epsilon_if_approved"]
    assert "by the gate's reading" in refused.json()["detail"] and "non-adaptive RDP ε" in refused.json()["detail"]
    assert len(client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()) == entries

    assert charge(client, silo, "rest", {**R1_STEP, "steps": 61}).status_code == 201
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    assert detail["gated_on"] == "plan_and_filter" and detail["plan"]["units_used"] == 14_062
    assert detail["epsilon_spent"] == pytest.approx(plan["epsilon"], rel=1e-12)
    assert detail["epsilon_remaining"] == pytest.approx(2.6 - plan["epsilon"], rel=1e-9)  # the silo stays open
    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    assert [e["event"] for e in history[:2]] == ["create", "plan"]
    assert history[1]["subject"]["plan"]["epsilon"] == plan["epsilon"]
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


def test_a_charge_off_the_plan_ends_its_branch_never_the_silo(client, make_silo, database_url: str) -> None:
    silo = make_silo(epsilon=2.0, dataset_size=60_000, horizon=None)
    plan = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": {**R1_STEP, "steps": 3_000}}, headers=ADMIN).json()
    assert charge(client, silo, "a", {**R1_STEP, "steps": 10}).status_code == 201
    pairs = filter_of(client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json())  # fixed by that first charge
    off = charge(client, silo, "off", {**R1_STEP, "noise_multiplier": 1.0})
    assert off.status_code == 201, off.text
    runs = [(Q, 1.1, 10), (Q, 1.0, 1)]
    assert off.json()["epsilon_spent"] == pytest.approx(proven_epsilon(pairs, dpsgd_curve(runs), delta=1e-5), rel=1e-9)
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    reserve_off = next(e["seq"] for e in history if e["event"] == "reserve" and e["charge_id"] == off.json()["charge_id"])
    assert detail["plan"]["ended_at_seq"] == reserve_off and detail["gated_on"] == "rdp_filter"
    # The plan's next units are read by the filter alone from now on: the branch never comes back.
    back = charge(client, silo, "back", {**R1_STEP, "steps": 2_900})
    runs.append((Q, 1.1, 2_900))
    expected = proven_epsilon(pairs, dpsgd_curve(runs), delta=1e-5)
    assert expected > plan["epsilon"]  # where the plan's branch would have read less
    assert back.status_code == 201 and back.json()["epsilon_spent"] == pytest.approx(expected, rel=1e-9)
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True

    # No hash covers the silo's place on its plan: the audit recomputes it from the charges, so an
    # operator's edit that revives the ended branch (or moves it along) is named.
    engine = create_engine(database_url)
    for edit in ("plan_ended_seq = NULL", "plan_used = plan_used + 1"):
        with engine.begin() as connection:
            connection.execute(text(f"UPDATE silos SET {edit} WHERE id = :i"), {"i": silo.id})
        report = client.get("/v1/audit/verify", headers=ADMIN).json()
        assert report["ok"] is False and report["first_bad_silo_id"] == silo.id, edit
        assert any(f"is not what its charges make it (10 units taken, branch ended at entry {reserve_off})" in p
                   for p in report["problems"]), report["problems"]
        with engine.begin() as connection:
            connection.execute(text("UPDATE silos SET plan_ended_seq = :s, plan_used = 10 WHERE id = :i"),
                               {"s": reserve_off, "i": silo.id})
        assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True
    engine.dispose()


def test_stopping_early_is_free_and_a_plan_comes_before_any_charge_once(client, make_silo) -> None:
    silo = make_silo(epsilon=2.0, dataset_size=60_000, horizon=None)
    plan = {**R1_STEP, "steps": 3_000}
    assert client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": plan}, headers=ADMIN).status_code == 201
    again = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": plan}, headers=silo.headers)
    assert again.status_code == 409 and "fixed once" in again.json()["detail"]
    assert charge(client, silo, "a", {**R1_STEP, "steps": 10}).status_code == 201
    # Stopping here costs at most the plan's ε (here the filter's reading is lower), whatever the silo does next.
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    by_filter = proven_epsilon(filter_of(detail), dpsgd_curve([(Q, 1.1, 10)]), delta=1e-5)
    assert detail["epsilon_spent"] == pytest.approx(min(pld_oracle(3_000, 0.5e-5), by_filter), rel=1e-9)

    charged = make_silo(epsilon=2.0, dataset_size=60_000)
    assert charge(client, charged, "a", R1_STEP).status_code == 201
    late = client.post(f"/v1/silos/{charged.id}/plan", json={"mechanism": plan}, headers=charged.headers)
    assert late.status_code == 409 and "before the first charge" in late.json()["detail"]

    small = make_silo(epsilon=1.0, dataset_size=60_000)
    over = client.post(f"/v1/silos/{small.id}/plan", json={"mechanism": R1_PLAN}, headers=small.headers)
    assert over.status_code == 409
    assert over.json()["epsilon_if_approved"] == pytest.approx(pld_oracle(14_062, 0.5e-5), rel=1e-9)
    assert client.get(f"/v1/silos/{small.id}", headers=ADMIN).json()["plan"] is None

    other = make_silo()
    # Another silo's key: refused, and told nothing about this silo (the service answers 404 there).
    assert client.post(f"/v1/silos/{small.id}/plan", json={"mechanism": plan}, headers=other.headers).status_code in (403, 404)
    unpriceable = client.post(f"/v1/silos/{small.id}/plan", json={"mechanism": {"type": "zcdp", "rho": 0.01}}, headers=ADMIN)
    assert unpriceable.status_code == 422 and unpriceable.json()["detail"][0]["loc"] == ["body", "mechanism"]


def test_the_filter_is_in_the_record_the_create_entry_and_the_hash_chain(client, make_silo, database_url: str) -> None:
    # The horizon declared is the default one's step (q = 256/60000, σ 1): a few orders hold 0.99 of δ,
    # the end's first (9.1 or a neighbour), the early steps' after it.
    silo = make_silo(epsilon=2.6, dataset_size=60_000, horizon={**R1_STEP, "noise_multiplier": 1.0})
    detail = client.get(f"/v1/silos/{silo.id}", headers=silo.headers).json()
    assert detail["gated_on"] == "rdp_filter"
    head = [w for w in detail["filter"]["weights"] if w > 0.01 / 150]
    assert 8.5 <= detail["filter"]["orders"][0] <= 9.5 and sum(head) == pytest.approx(0.99, rel=1e-9) and len(head) <= 4
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
    # As the silo would store it (issue 46: the quote priced it on the whole δ, 2.3817, the silo on its half).
    assert quote["epsilon_plan"] == pytest.approx(pld_oracle(14_062, 0.5e-5), rel=1e-9)
    twin = make_silo(epsilon=3.0, dataset_size=60_000, horizon=R1_STEP)
    declared = client.post(f"/v1/silos/{twin.id}/plan", json={"mechanism": R1_PLAN}, headers=twin.headers).json()
    assert quote["epsilon_plan"] == declared["epsilon"]
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
    assert on_plan["gated_on"] == "plan_and_filter" and on_plan["epsilon_plan"] is None

    no_silo = client.post("/v1/quote", json={"mechanism": R1_PLAN | {"batch_size": None, "sampling_rate": Q},
                                             "delta": 1e-5}, headers=ADMIN).json()
    assert no_silo["gated_on"] is None
    assert no_silo["epsilon_plan"] == pytest.approx(pld_oracle(14_062), rel=1e-9)
    assert no_silo["epsilon"] < no_silo["epsilon_rdp_proven"] < no_silo["epsilon"] * 1.01


def test_beside_a_plan_the_first_charge_fits_the_filter_to_the_half_of_delta_it_is_read_on(client, make_silo) -> None:
    """A silo with no horizon whose plan is a central job of 554 steps at q = 0.001, σ 0.644, budgeted
    at dp-accounting's RDP ε of the run on the whole δ. Its filter is read on half of δ; fitted by the
    first charge on the whole δ, it afforded none of the steps dp-accounting affords on that half (112),
    so a job that left its plan had nothing left (bench/tightness.py, a plan left). Fitted on the half
    it is read on, it buys ⌈0.95·K⌉ of them (or K − 1: units are whole)."""
    q, sigma, steps, delta = 60 / 60_000, 0.644, 554, 1e-5
    step = {"type": "dpsgd", "batch_size": 60, "noise_multiplier": sigma, "steps": 1}

    def dpa(n: int, on: float) -> float:
        accountant = rdp_lib.RdpAccountant()
        accountant.compose(de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma)), n)
        return float(accountant.get_epsilon(on))

    budget = dpa(steps, delta)
    silo = make_silo(epsilon=budget, dataset_size=60_000, horizon=None)
    declared = client.post(f"/v1/silos/{silo.id}/plan", json={"mechanism": {**step, "steps": steps}}, headers=silo.headers)
    assert declared.status_code == 201, declared.text
    assert charge(client, silo, "first", step).status_code == 201
    pairs = filter_of(client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json())
    assert math.fsum(w for _, w in pairs) <= 0.5

    def largest(fits) -> int:  # type: ignore[no-untyped-def]
        lo, hi = 0, steps + 1  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    affordable = largest(lambda n: dpa(n, delta / 2) <= budget)
    bought = largest(lambda n: proven_epsilon(pairs, dpsgd_curve([(q, sigma, n)]), delta=delta) <= budget)
    assert affordable == 112
    assert bought >= min(math.ceil(0.95 * affordable), affordable - 1), (bought, affordable)
