"""A job's rounds priced for one silo in one request: how many its remaining budget buys, read by
the silo's own gate exactly as it will approve them, one charge after another. Reserves nothing.

`dpledger train --plan` once asked `POST /v1/quote` a dozen times per silo (a doubling, then a
bisection), and each quote also computed a PLD ε that a plan never shows; here each distinct
mechanism is priced once and every candidate is the running sum the gate would hold.
"""

from __future__ import annotations

from dpledger.service.accounting import cost, plans, rdp
from dpledger.service.accounting import filter as rdp_filter
from dpledger.service.accounting.events import MechanismError, resolve
from dpledger.service.accounting.running_sum import RunningSum
from dpledger.service.ledger import charges, gate, silos
from dpledger.service.ledger.errors import Conflict, InvalidRequest
from dpledger.service.store.db import Database
from dpledger.service.store.models import Silo
from dpledger.wire.mechanisms import AnyMechanism, DpSgd
from dpledger.wire.schemas import RoundsQuote, RoundsQuoteRequest, finite_or_none


def quote_rounds(db: Database, body: RoundsQuoteRequest) -> RoundsQuote:
    with db.read() as session:
        silo = silos.get(session, body.silo_id)
    silos.refuse_if_retired(silo)  # no round of a job would be approved: its plan is refused, not priced
    if gate.closed_by_plan(silo):
        raise Conflict(f"silo {silo.id} is on its declared plan: it is approved the plan's units only, nothing else")
    declared = [run.mechanism for run in body.runs for _ in range(run.count)]
    _price(silo, body)  # all of it, before any of it runs
    # Each run's mechanism keyed once (one JSON dump a run, not one a round: 8,605 dumps of a large
    # mechanism took 3 s of CPU), its curve priced and computed once per distinct key.
    keys = [None if run.mechanism is None else run.mechanism.model_dump_json() for run in body.runs]
    rounds = [key for key, run in zip(keys, body.runs, strict=True) for _ in range(run.count)]
    curves, resolved, declared_by_key = {}, {}, {}
    for index, (key, run) in enumerate(zip(keys, body.runs, strict=True)):
        if run.mechanism is not None and key not in curves:
            try:
                priced = charges.price(run.mechanism, silo=silo, charged=False, path=f"runs.{index}.mechanism")
            except MechanismError as error:
                raise InvalidRequest(error.field, error.message) from error
            curves[key], resolved[key], declared_by_key[key] = priced.curve, priced.mechanism, run.mechanism
            cost.tick()
    # Beside a plan: whether its branch is still alive after each round (the rounds follow it or not).
    alive = gate.plan_path(silo, [None if key is None else resolved[key] for key in rounds])
    # What the gate would hold after each round: the spent sum, plus each round's charge in turn.
    spent = RunningSum.from_json(silo.rdp_spent)
    after = [spent]
    for key in rounds:
        after.append(after[-1] if key is None else after[-1].add(curves[key]))
        cost.tick()

    # The first charged round: where the job's first rounds charge nothing, the first one that does.
    first_index = next((n for n, key in enumerate(rounds, start=1) if key is not None), None)
    # A pending (or refittable) silo's filter is the one its first round would leave (gate.open_to_first), computed once here
    # (its allocation costs ~0.01–0.5 s, allowed to the request's bound as it runs; gate.reading would
    # redo it at every reading).
    fixed = None
    if first_index is not None and gate.open_to_first(silo):
        first_key = rounds[first_index - 1]
        fixed = gate.spec(silo, first=gate.first_charge(silo, curves[first_key], declared_by_key[first_key]))

    def gate_epsilon(n: int, running: RunningSum) -> float:
        """gate.reading of the sum after `n` rounds, under the filter `fixed` where the silo is pending
        (its spent sum is empty: it holds no charge), as plans.gate_epsilon reads it beside a plan."""
        if fixed is None:
            return gate.reading(silo, running, alive=alive[n]).epsilon
        by_filter = rdp_filter.read(fixed, running.curve(), delta=silo.delta).epsilon
        declared_plan = gate.plan(silo)
        if declared_plan is None:
            return by_filter
        ran = first_index is not None and n >= first_index
        return plans.gate_epsilon(declared_plan, on_plan=alive[n], ran=ran, by_filter=by_filter)

    def fits(n: int) -> bool:
        cost.tick()
        return rdp.within_budget(gate_epsilon(n, after[n]), budget=silo.epsilon)

    # A running sum only grows, so the rounds that fit are a prefix: bisect for its end.
    low, high = 0, len(declared) + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    sigma, note = _calibrated(silo, declared[: body.rounds]) if body.calibrate else (None, None)
    def gate_eps(n: int, running: RunningSum) -> float | None:
        return finite_or_none(gate_epsilon(n, running))

    def reference(running: RunningSum) -> float | None:
        return finite_or_none(rdp.epsilon(running.curve(), delta=silo.delta)[0])

    return RoundsQuote(
        silo_id=silo.id, epsilon=silo.epsilon, delta=silo.delta,
        epsilon_spent=finite_or_none(gate.reading(silo, spent).epsilon), epsilon_spent_dp_accounting=reference(spent),
        epsilon_after_first_round=None if first_index is None else gate_eps(first_index, after[first_index]),
        epsilon_after_first_round_dp_accounting=None if first_index is None else reference(after[first_index]),
        affordable_rounds=low, horizon=len(declared),
        epsilon_after_rounds=gate_eps(body.rounds, after[body.rounds]),
        epsilon_after_rounds_dp_accounting=reference(after[body.rounds]),
        noise_multiplier=sigma, noise_note=note,
    )


def _calibrated(silo: Silo, rounds: list[AnyMechanism | None]) -> tuple[float | None, str | None]:
    """The service's σ for these rounds (silos.plan_noise, the gate's conversion), where every one is
    the same plain DP-SGD; else why not."""
    first = rounds[0]
    if not isinstance(first, DpSgd) or first.batch_size is None or any(m != first for m in rounds):
        return None, "σ is calibrated only where every round is the same plain DP-SGD of a batch_size"
    plan = silos.plan_noise(silo, batch_size=first.batch_size, steps=len(rounds) * first.steps, first_steps=first.steps)
    return plan.noise_multiplier, None


# Following a plan, each round's charge is cut into the plan's units (plans.segments) and matched:
# ~2 µs a node of its mechanism, measured; a round quote does it for every round while the plan lives.
PLAN_STEP_SECONDS = 2e-6


def _price(silo: Silo, body: RoundsQuoteRequest) -> None:
    """The rounds' work priced together before any of it runs: their distinct mechanisms' leaves
    counted once across all of them (the curve cache computes each once), and, beside a live plan,
    every round matched against it (rounds × its mechanism's nodes). Over one request's price: a
    422 naming `runs`, with what would fit."""
    total, seen = cost.Estimate(), set()
    following = 0.0
    for index, run in enumerate(body.runs):
        if run.mechanism is None:
            continue
        path = f"runs.{index}.mechanism"
        try:
            walk = cost.estimate(resolve(run.mechanism, dataset_size=silo.dataset_size, charged=False, path=path), path=path)
        except MechanismError as error:
            raise InvalidRequest(error.field, error.message) from error
        following += run.count * walk.nodes * PLAN_STEP_SECONDS
        key = run.mechanism.model_dump_json()
        if key not in seen:
            seen.add(key)
            total.merge(walk)
    if not gate.on_plan(silo):
        following = 0.0
    seconds = total.rdp_seconds + following
    if seconds > cost.MAX_SECONDS:
        what = (f"{len(seen)} distinct mechanisms holding {len(total.leaves)} distinct leaves, {total.sampled} of them "
                f"sampled" + ("" if following < 0.05 else f", and {following:.2g} s matching every round to the plan"))
        dearest = max(total.leaves.values(), default=cost.NODE_SECONDS)
        raise InvalidRequest("runs", f"would cost dp-accounting about {seconds:.1f} s of CPU ({what}); one request may "
                                     f"cost at most {cost.MAX_SECONDS:g} s, about {int(cost.MAX_SECONDS / dearest)} of its "
                                     "dearest leaf: quote fewer distinct mechanisms per request, or reuse leaves")
    cost.admit(following)
