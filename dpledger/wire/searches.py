"""Wire models of private hyperparameter searches that both the service and the worker's client read.

The request models stay beside their route (`dpledger.service.api.routes.searches`): validating a
search request needs the service's trial-count laws.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dpledger.wire.enums import SearchStatus
from dpledger.wire.receipts import RECEIPT_NOTE, Receipt

DistributionKind = Literal["poisson", "geometric", "logarithmic", "truncated_negative_binomial"]


class SearchStarted(BaseModel):
    search_id: int
    trials: int = Field(description="K, drawn by the service: run exactly this many trials")
    charge_id: int
    epsilon_spent: float = Field(description="the silo's ε right after the search was approved")
    receipt: Receipt | None = Field(None, description=RECEIPT_NOTE + " (the search charge's reserve entry)")


class SearchDetail(BaseModel):
    search_id: int
    silo_id: int
    charge_id: int
    trial: dict[str, Any]
    distribution: DistributionKind
    shape: float | Literal["infinity"]
    mean_trials: float
    trials: int
    trials_reported: int
    best_score: float | None
    status: SearchStatus


class TrialReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    score: Annotated[float, Field(allow_inf_nan=False, description="higher is better (e.g. accuracy)")]
