"""What a mechanism would cost, and the noise that fits a budget, before anyone spends."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter

from dpledger.service.accounting import cost, plans, rdp, reports
from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting.events import MechanismError
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.api.admission import TOO_MANY, AdmittedDep
from dpledger.service.api.deps import READERS, DbDep, Principal
from dpledger.service.ledger import charges, gate, round_quotes
from dpledger.service.ledger.errors import InvalidRequest
from dpledger.service.store.db import Database
from dpledger.service.store.models import Role
from dpledger.wire.mechanisms import AnyMechanism
from dpledger.wire.schemas import (
    CalibrateRequest,
    CalibrateResponse,
    QuoteRequest,
    QuoteResponse,
    RoundsQuote,
    RoundsQuoteRequest,
    finite_or_none,
)

router = APIRouter(prefix="/v1", tags=["quotes"])


@router.post("/quote", response_model=QuoteResponse, name="quote", responses=TOO_MANY)
def quote(body: QuoteRequest, caller: AdmittedDep, db: DbDep) -> QuoteResponse:
    """What the mechanism costs alone (RDP, and PLD where within bounds), and with `silo_id` what
    approving it would leave that silo at: the same preview a reservation decides on. Priced before
    any work, under one guard: its RDP curve first (over the price: a 422), then the PLD report and
    the plan's price where what is left of the request's price covers them (else a note says why)."""
    with cost.guard("mechanism"):
        return _quote(body, caller, db)


def _quote(body: QuoteRequest, caller: Principal, db: Database) -> QuoteResponse:
    preview = None
    if body.silo_id is not None:
        caller.require_silo(body.silo_id, also=READERS)  # a silo's spend is a budget: coordinators may not see it
        preview = charges.preview(db, silo_id=body.silo_id, mechanism=body.mechanism, charged=False)
        priced = preview.priced
    else:
        priced = charges.price(body.mechanism, silo=None, charged=False)
    delta = body.delta if body.delta is not None else (preview.silo.delta if preview is not None else None)
    if delta is None:
        raise InvalidRequest("delta", "is required when no silo_id is given")
    alone = rdp.guarantee(priced.curve, delta=delta)
    pld = reports.pld_epsilon(priced.mechanism, delta=delta, skip_reason=priced.pld_skip_reason)
    answer = QuoteResponse(
        epsilon=finite_or_none(alone.epsilon), order=alone.order, rho=alone.rho,
        epsilon_pld=pld.epsilon, pld_note=pld.unsupported_reason, delta=delta,
    )
    if preview is None:
        _plan_price(answer, priced.mechanism, delta=delta, closed=None)
        spec = rdp_filter.spread_spec(alone.order, source="horizon")
        answer.epsilon_rdp_proven = finite_or_none(rdp_filter.read(spec, priced.curve, delta=delta).epsilon)
        return answer
    silo = preview.silo
    # As the silo would store it (silos.declare_plan): its PLD ε on the plan's share of the silo's δ.
    _plan_price(answer, priced.mechanism, delta=silo.delta * plans.PLAN_DELTA_SHARE, closed=preview.plan_closed)
    answer.silo_epsilon_spent = finite_or_none(preview.check.epsilon_spent)
    answer.epsilon_if_approved = finite_or_none(preview.check.epsilon_if_approved)
    # Beside each, labelled as a reference: dp-accounting's non-adaptive RDP ε of the same charges.
    spent = RunningSum.from_json(silo.rdp_spent).curve()
    references = rdp.epsilons(np.vstack([spent, preview.check.candidate.curve()]), delta=silo.delta)
    answer.silo_epsilon_spent_dp_accounting = finite_or_none(float(references[0]))
    answer.epsilon_if_approved_dp_accounting = finite_or_none(float(references[1]))
    # The silo's own filter on the running sum a charge would leave (on a plan, the gate reads the plan instead).
    answer.epsilon_rdp_proven = finite_or_none(
        rdp_filter.read(gate.spec(silo, first=gate.first_charge(silo, priced.curve, priced.mechanism)),
                        preview.check.candidate.curve(), delta=silo.delta).epsilon
    )
    answer.gated_on = gate.gated_on(silo)
    return answer


def _plan_price(answer: QuoteResponse, mechanism: AnyMechanism, *, delta: float, closed: str | None) -> None:
    """The mechanism's PLD ε as a plan at `delta` (a silo's: its plan's share of δ), or why it cannot
    be one (`closed`: why the silo may not declare one)."""
    if closed is not None:
        answer.plan_note = closed
        return
    try:
        # Beside the answer, optional: within what is left of cost.OPTIONAL_SECONDS, else a note says why.
        answer.epsilon_plan = finite_or_none(plans.pld_epsilon(mechanism, delta=delta, budget=cost.OPTIONAL_SECONDS))
    except MechanismError as error:
        answer.plan_note = error.message


@router.post("/calibrate", response_model=CalibrateResponse, name="calibrate", responses=TOO_MANY)
def calibrate(body: CalibrateRequest, caller: AdmittedDep) -> CalibrateResponse:
    """The smallest DP-SGD noise multiplier whose ε at δ stays within the target, with a margin so
    that a plan calibrated to a silo's whole budget still passes the ledger's exact gate."""
    with cost.guard("epsilon"):
        sigma, eps = reports.calibrate_dpsgd_noise(
            epsilon=body.epsilon, delta=body.delta, sampling_rate=body.sampling_rate, steps=body.steps
        )
    return CalibrateResponse(noise_multiplier=sigma, epsilon=eps)


@router.post("/quote/rounds", response_model=RoundsQuote, name="quote_rounds", responses=TOO_MANY)
def quote_rounds(body: RoundsQuoteRequest, caller: AdmittedDep, db: DbDep) -> RoundsQuote:
    """A job's rounds for one silo, priced in one request: how many of them its remaining budget buys,
    read by its gate as it will approve them one by one (what `dpledger train --plan` prints); with
    `calibrate`, the σ for the job's rounds. Reserves nothing. Calibration answers from the silo's
    budget, so it takes the silo's own key or an admin's, as `POST /v1/silos/{id}/calibrate` does."""
    caller.require_silo(body.silo_id, also=(Role.admin,) if body.calibrate else READERS)
    with cost.guard("runs"):
        return round_quotes.quote_rounds(db, body)
