"""What the proven gate costs in ε: the ledger's reading ÷ dp-accounting's best-order RDP ε of the
same charges, before and after the path allocation of the filter's δ, side by side.

    python bench/tightness.py        # ~10 s

Workloads (δ = 1e-5; "budgeted for N" = the budget is dp-accounting's RDP ε of those N units):

- a federated silo of 135 records (batch 16, σ 1.2, 10 steps a round) budgeted for 20 rounds, with
  its horizon declared (one round), with none, and with a declared 20-round plan;
- central DP-SGD (q = 256/60000, σ 1.0) budgeted for 10,000 steps, no horizon declared, charged one
  step at a time, and the same silo charged σ 1.5 steps instead.

A silo with no declared horizon has its filter fixed by its first charge (gate.pending; "before",
the default horizon's filter: DP-SGD at q = min(0.01, 256/size), σ 1).

Both columns go through the service's own code: the silo's filter from ledger/silos.py (filter_for,
as registration chooses it) and the reading from ledger/gate.py (reading, as every approval makes
it) on a Silo row held in memory. "before" is the rule this replaced, still in accounting/filter.py:
0.9 of δ on the order where the horizon spends the budget (committed_order), 0.1 over the other
155 (spread_spec), and a declared plan gating its silo alone; "after", a plan beside the filter,
each on half of δ (accounting/plans.py). dp-accounting's ε is its RdpAccountant on its own curves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting import plans, rdp
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger import gate, silos
from dpledger.service.ledger.models import Silo
from dpledger.wire.mechanisms import AnyMechanism, DpSgd

DELTA = 1e-5
SILO_SIZE, SILO_BATCH, SILO_SIGMA, ROUND_STEPS, ROUNDS = 135, 16, 1.2, 10, 20
CENTRAL_SIZE, CENTRAL_BATCH, CENTRAL_SIGMA, CENTRAL_STEPS = 60_000, 256, 1.0, 10_000


def dp_accounting_epsilon(q: float, sigma: float, steps: int) -> float:
    accountant = rdp_lib.RdpAccountant(list(rdp.ORDERS))
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return float(accountant.get_epsilon(DELTA))


def dpsgd(q: float, sigma: float, steps: int) -> DpSgd:
    return DpSgd(noise_multiplier=sigma, steps=steps, sampling_rate=q)


def old_rule(*, epsilon: float, dataset_size: int, horizon: AnyMechanism | None) -> rdp_filter.FilterSpec:
    mechanism = horizon if horizon is not None else rdp_filter.default_horizon(dataset_size)
    curve = rdp.certified_curve(mechanism)
    return rdp_filter.spread_spec(rdp_filter.committed_order(curve, epsilon=epsilon, delta=DELTA), source="horizon")


def new_rule(*, epsilon: float, dataset_size: int, horizon: AnyMechanism | None) -> rdp_filter.FilterSpec:
    return silos.filter_for(epsilon=epsilon, delta=DELTA, dataset_size=dataset_size, horizon=horizon)


Rule = Callable[..., rdp_filter.FilterSpec]


def silo_row(spec: rdp_filter.FilterSpec, *, epsilon: float, plan: plans.Plan | None = None) -> Silo:
    # A pending filter (no horizon declared, today's rule) is fixed by the silo's first charge.
    return Silo(id=1, epsilon=epsilon, delta=DELTA, filter_spec=spec.to_json(),
                filter_seq=gate.PENDING_SEQ if spec.source == "pending" else 1,
                plan=None if plan is None else plan.to_json(), plan_used=0)


def ratio(silo: Silo, q: float, sigma: float, steps: int, *, unit: int) -> float:
    """The gate's reading of `steps` DP-SGD steps charged to `silo` `unit` steps a charge, ÷
    dp-accounting's ε of them (the first charge fixes a pending silo's filter, as reserve does)."""
    running = RunningSum.empty(len(rdp.ORDERS)).add(rdp.certified_curve(dpsgd(q, sigma, steps)))
    first = rdp.certified_curve(dpsgd(q, sigma, unit)) if gate.pending(silo) else None
    return gate.reading(silo, running, first=first).epsilon / dp_accounting_epsilon(q, sigma, steps)


def declared_plan(q: float, sigma: float, steps: int, *, alone: bool) -> plans.Plan:
    """The plan as silos.declare_plan prices it: today beside the filter on its share of δ; `alone`:
    the rule before (the plan alone on the whole δ, the silo closed)."""
    mechanism = dpsgd(q, sigma, steps)
    share = 1.0 if alone else plans.PLAN_DELTA_SHARE
    return plans.Plan(mechanism=mechanism.model_dump_json(), segments=tuple(plans.segments(mechanism)),
                      epsilon=plans.pld_epsilon(mechanism, delta=DELTA * share),
                      after=plans.AFTER_PLAN if alone else plans.ALONGSIDE, delta_share=share)


def rows(rule: Rule) -> list[tuple[str, list[float]]]:
    q = SILO_BATCH / SILO_SIZE
    budget = dp_accounting_epsilon(q, SILO_SIGMA, ROUNDS * ROUND_STEPS)
    one_round = dpsgd(q, SILO_SIGMA, ROUND_STEPS)
    declared = silo_row(rule(epsilon=budget, dataset_size=SILO_SIZE, horizon=one_round), epsilon=budget)
    undeclared = silo_row(rule(epsilon=budget, dataset_size=SILO_SIZE, horizon=None), epsilon=budget)
    planned = silo_row(rule(epsilon=budget, dataset_size=SILO_SIZE, horizon=None), epsilon=budget,
                       plan=declared_plan(q, SILO_SIGMA, ROUNDS * ROUND_STEPS, alone=rule is old_rule))
    qc = CENTRAL_BATCH / CENTRAL_SIZE
    central_budget = dp_accounting_epsilon(qc, CENTRAL_SIGMA, CENTRAL_STEPS)
    central = silo_row(rule(epsilon=central_budget, dataset_size=CENTRAL_SIZE, horizon=None), epsilon=central_budget)
    return [
        ("silo, horizon one round: after 1 / 3 / 20 rounds",
         [ratio(declared, q, SILO_SIGMA, r * ROUND_STEPS, unit=ROUND_STEPS) for r in (1, 3, 20)]),
        ("silo, no horizon: after 1 / 3 / 20 rounds",
         [ratio(undeclared, q, SILO_SIGMA, r * ROUND_STEPS, unit=ROUND_STEPS) for r in (1, 3, 20)]),
        ("silo, 20-round plan: after 1 / 3 / 20 rounds",
         [ratio(planned, q, SILO_SIGMA, r * ROUND_STEPS, unit=ROUND_STEPS) for r in (1, 3, 20)]),
        ("central σ 1.0: after 1,000 / 10,000 steps", [ratio(central, qc, CENTRAL_SIGMA, n, unit=1) for n in (1_000, 10_000)]),
        ("central, σ 1.5 steps: after 1 / 10 / 100", [ratio(central, qc, 1.5, n, unit=1) for n in (1, 10, 100)]),
    ]


GOALS = ["≤ 1.15 / 1.10 / 1.02", "≤ 1.15 / 1.10 / 1.03", "— / ≤ 1.15 / 0.95", "≤ 1.15 / 1.02", "—"]


def main() -> None:
    before, after = rows(old_rule), rows(new_rule)
    width = max(len(name) for name, _ in before)
    print(f"{'workload (ledger ÷ dp-accounting RDP ε)':<{width}}  {'before':<22}  {'after':<22}  goal")
    for (name, old), (_, new), goal in zip(before, after, GOALS, strict=True):
        print(f"{name:<{width}}  {' / '.join(f'{r:.3f}' for r in old):<22}  {' / '.join(f'{r:.3f}' for r in new):<22}  {goal}")


if __name__ == "__main__":
    main()
