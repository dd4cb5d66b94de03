"""Private hyperparameter searches (Liu et al. 2022 §7): start one, report its trials, quote its cost.

The wire models live here, beside their only routes, so that this feature's API stays in one file.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Response, status
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dpledger.service.accounting import cost
from dpledger.service.accounting.trial_counts import (
    MAX_MEAN_TRIALS,
    TrialDistribution,
    distribution,
)
from dpledger.service.api.admission import TOO_MANY, AdmittedDep
from dpledger.service.api.deps import READERS, DbDep, IdPath, PrincipalDep
from dpledger.service.api.errors import spend_route
from dpledger.service.api.receipts import SignerDep, receipt
from dpledger.service.ledger import searches
from dpledger.service.store.models import Role, Search, SearchStatus
from dpledger.wire.mechanisms import Mechanism, check_nesting
from dpledger.wire.schemas import Delta, Text, finite_or_none
from dpledger.wire.searches import DistributionKind, SearchDetail, SearchStarted, TrialReport

router = APIRouter(tags=["searches"])

MeanTrials = Annotated[float, Field(ge=1, le=MAX_MEAN_TRIALS, allow_inf_nan=False, description="E[K]")]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _WithTrial(_Request):
    trial: Mechanism = Field(description="one trial's whole mechanism (e.g. a training run's dpsgd)")

    @field_validator("trial", mode="before")
    @classmethod
    def _bounded_nesting(cls, value: Any) -> Any:
        return check_nesting(value)


class DistributionSpec(_Request):
    kind: DistributionKind
    shape: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="η, only for truncated_negative_binomial"
    )


class SearchRequest(_WithTrial):
    mean_trials: MeanTrials
    distribution: DistributionSpec
    idempotency_key: Text

    @model_validator(mode="after")
    def _law(self) -> SearchRequest:
        self.law()  # a kind/shape mismatch is a 422 here, before anything is reserved
        return self

    def law(self) -> TrialDistribution:
        return distribution(self.distribution.kind, mean=self.mean_trials, shape=self.distribution.shape)


class SearchQuoteRequest(_WithTrial):
    mean_trials: MeanTrials
    delta: Delta
    grid_size: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None, description="trials of the naive search (default: mean_trials rounded up)"
    )
    tnb_shapes: Annotated[list[Annotated[float, Field(gt=0, allow_inf_nan=False)]], Field(max_length=16)] = Field(
        default_factory=lambda: [0.5], description="η values of truncated_negative_binomial to quote"
    )


class DistributionQuote(BaseModel):
    kind: DistributionKind
    shape: float | Literal["infinity"]
    epsilon: float | None


class SearchQuote(BaseModel):
    delta: float
    trial_epsilon: float | None
    naive_grid_size: int
    naive_epsilon: float | None = Field(description="grid_size trials composed (self_composed)")
    distributions: list[DistributionQuote]


def _detail(search: Search) -> SearchDetail:
    shape: float | Literal["infinity"] = "infinity" if search.shape == "infinity" else float(search.shape)
    return SearchDetail(
        search_id=search.id, silo_id=search.silo_id, charge_id=search.charge_id,
        trial=json.loads(search.trial_mechanism), distribution=search.distribution,
        shape=shape, mean_trials=search.mean_trials, trials=search.trials, trials_reported=search.trials_reported,
        best_score=search.best_score, status=SearchStatus(search.status),
    )


@spend_route(
    router, "/v1/silos/{silo_id}/searches", model=SearchStarted, name="start_search",
    replay="the search already started", over_budget="nothing was written, no K drawn",
)
def start_search(
    silo_id: IdPath, body: SearchRequest, caller: AdmittedDep, db: DbDep, signer: SignerDep,
    response: Response,
) -> SearchStarted:
    caller.require_silo(silo_id)
    with cost.guard("trial"):  # the search's charge priced before its curve, as any charge (cost.py)
        started = searches.start(
            db, silo_id=silo_id, trial=body.trial, law=body.law(), idempotency_key=body.idempotency_key,
            key_id=caller.key_id,
        )
    if started.replayed:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    return SearchStarted(
        search_id=started.search.id, trials=started.search.trials, charge_id=started.search.charge_id,
        epsilon_spent=started.epsilon_spent, receipt=receipt(signer, started.position),
    )


@router.get("/v1/searches/{search_id}", response_model=SearchDetail, name="get_search")
def get_search(search_id: IdPath, caller: PrincipalDep, db: DbDep) -> SearchDetail:
    with db.read() as session:  # a search reveals a silo's spending: its silo and readers only
        return _detail(searches.get(session, search_id, silo_scope=caller.silo_scope(also=READERS)))


@router.post("/v1/searches/{search_id}/trials", response_model=SearchDetail, name="report_trial")
def report_trial(search_id: IdPath, body: TrialReport, caller: PrincipalDep, db: DbDep) -> SearchDetail:
    caller.require(Role.silo)  # by role: says nothing of which searches exist
    search = searches.report_trial(
        db, search_id=search_id, score=body.score, silo_scope=caller.silo_scope(also=()), key_id=caller.key_id
    )
    return _detail(search)


@router.post("/v1/searches/quote", response_model=SearchQuote, name="quote_search", responses=TOO_MANY)
def quote_search(body: SearchQuoteRequest, caller: AdmittedDep) -> SearchQuote:
    """The naive search (a fixed grid, every run composed) beside each random-K search of the same
    mean (Papernot & Steinke 2022), before anyone spends."""
    with cost.guard("trial"):  # every law's curve priced with the trial's before any runs (cost.py)
        quoted = searches.quote(
            body.trial, delta=body.delta, mean_trials=body.mean_trials, grid_size=body.grid_size,
            tnb_shapes=body.tnb_shapes,
        )
    return SearchQuote(
        delta=body.delta, trial_epsilon=finite_or_none(quoted.trial_epsilon), naive_grid_size=quoted.grid_size,
        naive_epsilon=finite_or_none(quoted.naive_epsilon),
        distributions=[
            DistributionQuote(kind=law.kind, shape=law.shape, epsilon=finite_or_none(eps)) for law, eps in quoted.searches
        ],
    )
