"""The round plan: one declaration per round, compared once with what the meter saw run."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from dpledger.trainer.federated.plan import QUANTILE_QUERIES, SELECTIONS, STEPS, PlannedQuery, QueryMeter, RoundPlan
from dpledger.wire.mechanisms import Composed, DpSgd, Gaussian
from tests.trainer import wire

DPSGD = DpSgd(batch_size=4, noise_multiplier=1.0, steps=3)
SELECT = DpSgd(batch_size=10, noise_multiplier=2.0, steps=1)
QUANTILE = Gaussian(noise_multiplier=5.0)

# Silo 0 runs steps and a selection, silo 1 steps only, silo 2 nothing.
PLAN = RoundPlan(
    round_index=7,
    queries=((PlannedQuery(STEPS, 3, DPSGD), PlannedQuery(SELECTIONS, 1, SELECT)), (PlannedQuery(STEPS, 3, DPSGD),), ()),
)
ALL = torch.tensor([True, True, True])


def run(meter: QueryMeter, steps: list[int], selections: list[int]) -> None:
    meter.start()
    for k, n in enumerate(steps):
        for _ in range(n):
            meter.record(STEPS, torch.tensor([k]))
    for k, n in enumerate(selections):
        for _ in range(n):
            meter.record(SELECTIONS, torch.tensor([k]))


def test_the_plan_declares_one_mechanism_per_silo_composed_where_it_queries_twice() -> None:
    assert PLAN.mechanisms() == [Composed(events=[DPSGD, SELECT]), DPSGD, None]
    assert wire(PLAN.mechanisms())[1] == {"type": "dpsgd", "batch_size": 4, "noise_multiplier": 1.0, "steps": 3}
    assert PLAN.queries_data().tolist() == [True, True, False]
    declared = PLAN.mechanisms()[1]
    assert isinstance(declared, DpSgd)
    with pytest.raises(ValidationError, match="frozen"):  # no caller can change what was approved
        declared.steps = 99
    assert PLAN.mechanisms()[1] == DPSGD


def test_what_ran_as_planned_passes_and_is_counted_per_kind_and_in_total() -> None:
    meter = QueryMeter(3)
    run(meter, [3, 3, 0], [1, 0, 0])
    PLAN.check(ALL, meter.since_start())
    run(meter, [0, 3, 0], [0, 0, 0])  # silo 0 refused this time
    PLAN.check(torch.tensor([False, True, True]), meter.since_start())
    assert meter.total(STEPS).tolist() == [3, 6, 0] and meter.total(SELECTIONS).tolist() == [1, 0, 0]


@pytest.mark.parametrize(
    ("steps", "selections", "active", "message"),
    [
        ([3, 2, 0], [1, 0, 0], ALL, r"Round 7: steps run \[3, 2, 0\] != approved \[3, 3, 0\]"),  # one step short
        ([3, 3, 1], [1, 0, 0], ALL, r"steps run \[3, 3, 1\]"),  # a silo that declared nothing was queried
        ([3, 3, 0], [1, 1, 0], ALL, r"selections run \[1, 1, 0\] != approved \[1, 0, 0\]"),  # undeclared selection
        ([3, 3, 0], [1, 0, 0], torch.tensor([False, True, True]), r"selections run \[1, 0, 0\] != approved \[0, 0, 0\]"),
    ],
)
def test_anything_other_than_the_approved_plan_fails_the_round(
    steps: list[int], selections: list[int], active: torch.Tensor, message: str
) -> None:
    meter = QueryMeter(3)
    run(meter, steps, selections)
    with pytest.raises(RuntimeError, match=message):
        PLAN.check(active, meter.since_start())


def test_a_query_that_reports_its_mechanism_must_report_the_declared_one() -> None:
    plan = RoundPlan(round_index=2, queries=((PlannedQuery(STEPS, 1, DPSGD), PlannedQuery(QUANTILE_QUERIES, 1, QUANTILE)),))
    meter = QueryMeter(1)
    meter.start()
    meter.record(STEPS, torch.tensor([0]))
    meter.record(QUANTILE_QUERIES, torch.tensor([0]), mechanism=Gaussian(noise_multiplier=4.0))
    with pytest.raises(RuntimeError, match=r"silo 0's quantile queries ran .*4\.0.*, declared .*5\.0"):
        plan.check(torch.tensor([True]), meter.since_start())
    meter.start()
    meter.record(STEPS, torch.tensor([0]))
    meter.record(QUANTILE_QUERIES, torch.tensor([0]), mechanism=Gaussian(noise_multiplier=5.0))
    plan.check(torch.tensor([True]), meter.since_start())
