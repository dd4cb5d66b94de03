"""A silo registered without a horizon: its filter is fixed by its first charge, from that charge
(the charge as the unit, the horizon as many units as the budget affords), through the real app.

The filter chosen is checked against the rule (filter.allocate on the charge's curve), the ε it
reads against dp-accounting's curves and conversion (tests/gate_oracle.py), the chain against the
audit, and a record edited back to "pending" after the filter was fixed is refused as tampered."""

from __future__ import annotations

import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from sqlalchemy import create_engine, text

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import rdp
from dpledger.wire.mechanisms import DpSgd
from tests.conftest import ADMIN
from tests.gate_oracle import dpsgd_curve, filter_of, proven_epsilon

SIZE, BATCH, SIGMA, STEPS, DELTA = 135, 16, 1.2, 10, 1e-5
ROUND = {"type": "dpsgd", "batch_size": BATCH, "noise_multiplier": SIGMA, "steps": STEPS}
Q = BATCH / SIZE


def budget_for(rounds: int) -> float:
    """dp-accounting's best-order RDP ε of `rounds` rounds: the silo is budgeted for them."""
    curve = STEPS * rounds * rdp_lib._compute_rdp_poisson_subsampled_gaussian(Q, SIGMA, rdp.ORDERS)
    return float(rdp_lib.compute_epsilon(rdp.ORDERS, curve, DELTA)[0])


def charge(client, silo, key: str, mechanism):  # type: ignore[no-untyped-def]
    return client.post(f"/v1/silos/{silo.id}/charges", json={"mechanism": mechanism, "idempotency_key": key},
                       headers=silo.headers)


def test_the_first_charge_fixes_the_filter_by_the_rule_and_the_gate_reads_it(client, make_silo) -> None:
    budget = budget_for(20)
    silo = make_silo(epsilon=budget, delta=DELTA, dataset_size=SIZE, horizon=None)
    before = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    assert before["filter"] is None and before["epsilon_spent"] == 0.0

    # A refused first charge (far past the budget) fixes nothing.
    refused = charge(client, silo, "huge", {**ROUND, "steps": 100 * 20 * STEPS})
    assert refused.status_code == 409, refused.text
    assert client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()["filter"] is None

    quoted = client.post("/v1/quote", json={"mechanism": ROUND, "silo_id": silo.id}, headers=silo.headers).json()
    first = charge(client, silo, "round-1", ROUND)
    assert first.status_code == 201, first.text
    detail = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    unit = rdp.certified_curve(DpSgd(noise_multiplier=SIGMA, steps=STEPS, sampling_rate=Q))
    rule = rdp_filter.allocate(unit, epsilon=budget, delta=DELTA)
    assert detail["filter"] == {"orders": list(rule.spec.orders), "weights": list(rule.spec.weights),
                                "source": "first_charge", "parts": []}
    # The rule's path: the budget affords 20 rounds of this charge (a hair more: the ledger's certified
    # fractional orders read below dp-accounting's), and the worst ratio it guarantees.
    assert 20 <= rule.units < 20.05 and rule.ratio < 1.15 and rule.end_ratio <= 1 + rdp_filter.END_EXCESS

    # The quote before the first charge priced it under the filter that charge fixed.
    oracle_1 = proven_epsilon(filter_of(detail), dpsgd_curve([(Q, SIGMA, STEPS)]), delta=DELTA)
    assert first.json()["epsilon_spent"] == pytest.approx(oracle_1, rel=1e-9)
    assert quoted["epsilon_if_approved"] == pytest.approx(oracle_1, rel=1e-9)
    for n in (2, 3):
        assert charge(client, silo, f"round-{n}", ROUND).status_code == 201
    spent = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()["epsilon_spent"]
    assert spent == pytest.approx(proven_epsilon(filter_of(detail), dpsgd_curve([(Q, SIGMA, 3 * STEPS)]), delta=DELTA), rel=1e-9)
    assert spent / budget_for(3) <= 1.15  # within the goal after 3 rounds, 1.25 (1.214 under the default horizon)

    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()
    assert [e["event"] for e in history[:3]] == ["create", "filter", "reserve"]
    assert "filter" not in (history[0]["subject"] or {}) and history[1]["subject"]["filter"] == {
        k: v for k, v in detail["filter"].items() if k != "parts"}
    assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is True


def test_a_record_edited_back_to_pending_after_its_first_charge_is_refused(client, make_silo, database_url: str) -> None:
    silo = make_silo(epsilon=budget_for(20), delta=DELTA, dataset_size=SIZE, horizon=None)
    assert charge(client, silo, "round-1", ROUND).status_code == 201
    engine = create_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE silos SET filter_seq = 0 WHERE id = :i"), {"i": silo.id})
        # Pending again, the next charge would fix another filter over a spent sum: refused instead.
        again = charge(client, silo, "round-2", {**ROUND, "steps": 200})
        assert again.status_code == 409 and again.json()["tampered"]["entry_seq"] == 2, again.text
        assert "still to be fixed by its first charge" in again.json()["detail"]
        assert client.get("/v1/audit/verify", headers=ADMIN).json()["ok"] is False
    finally:
        engine.dispose()
