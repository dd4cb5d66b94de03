"""Private hyperparameter searches (Liu et al. 2022 §7; Papernot & Steinke 2022; docs/ARCHITECTURE.md).

A search is ONE `repeat_and_select` charge over the trial mechanism, reserved up front through
`charges.reserve` (same lock, same idempotency, same refusal: an over-budget search writes nothing
and no trial runs). Only after the approval does the service draw K, so the protocol the accounting
assumes is the one that runs. Trials are then reported one by one; a (K+1)-th is refused, and the
K-th commits the charge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from dpledger.service.accounting import cost, rdp
from dpledger.service.accounting.events import MechanismError
from dpledger.service.accounting.trial_counts import TrialDistribution, distribution, draw_trials
from dpledger.service.ledger import charges, keys, silos, transparency
from dpledger.service.ledger.errors import Conflict, NotFound, SettledAlready
from dpledger.service.store import records
from dpledger.service.store.db import Database
from dpledger.service.store.models import Charge, ChargeRecord, ChargeStatus, Search, SearchStatus
from dpledger.wire.mechanisms import AnyMechanism, RepeatAndSelect


@dataclass(frozen=True)
class StartedSearch:
    search: Search
    epsilon_spent: float
    replayed: bool
    position: transparency.Position  # the search charge's reserve entry in the transparency log


def search_mechanism(trial: AnyMechanism, law: TrialDistribution) -> RepeatAndSelect:
    """What the whole search costs: the best of K runs of `trial`, K ~ law (Papernot & Steinke, Thm 2/6)."""
    return RepeatAndSelect(event=trial, mean=law.mean, shape=law.shape)


def start(
    db: Database,
    *,
    silo_id: int,
    trial: AnyMechanism,
    law: TrialDistribution,
    idempotency_key: str,
    key_id: int | None = None,
) -> StartedSearch:
    """The charge and the search (with its K) in ONE write transaction: an idempotency key names
    either a search or a plain charge, never both, and a replay returns the search it started."""
    mechanism = search_mechanism(trial, law)
    digest = charges.request_hash(mechanism=mechanism, job_id=None, round=None)
    with db.read() as session:
        silo = silos.get(session, silo_id)
        earlier = charges.by_key(session, silo_id, idempotency_key)
        if earlier is not None:
            return _replay(session, earlier, digest)
    try:
        priced = charges.price(mechanism, silo=silo, charged=True, path="search")
    except MechanismError as error:  # named as the request names it: the trial, not the search around it
        field = error.field.replace("search.event", "trial", 1).replace("search", "trial", 1)
        raise MechanismError(field, error.message) from error
    with db.write() as session:
        reservation = charges.reserve_locked(
            session, silo_id=silo_id, priced=priced, digest=digest, idempotency_key=idempotency_key, job_id=None, round=None,
            key_id=key_id,
        )
        if reservation.replayed:  # a concurrent retry got in between our read and the lock
            return _replay(session, reservation.charge, digest)
        # Drawn only now that the charge is approved: a refused search never learns a K.
        trials = draw_trials(law)
        search = Search(
            silo_id=silo_id, charge_id=reservation.charge_id, trial_mechanism=trial.model_dump_json(),
            distribution=law.kind, shape=str(law.shape), mean_trials=law.mean, trials=trials,
            trials_reported=0, best_score=None,
            status=SearchStatus.done if trials == 0 else SearchStatus.running, created_at=datetime.now(UTC),
        )
        session.add(search)
        session.flush()
    if trials == 0:
        # Poisson K = 0 (Papernot & Steinke, Thm 6): the search released "no result", and that
        # release is what the charge paid for; nothing is left to run.
        _commit(db, reservation.charge_id)
    return StartedSearch(search, reservation.epsilon_spent, False, reservation.position)


def _replay(session: Session, earlier: Charge | ChargeRecord, digest: str) -> StartedSearch:
    charges._same_request(earlier, digest)
    search = records.search_by_charge(session, earlier.id)
    if search is None:
        # The key names a plain charge (perhaps released): starting a search on it would run K
        # trials that no approval paid for.
        raise Conflict(
            f"idempotency key names charge {earlier.id} ({ChargeStatus(earlier.status).value}), which is no search; "
            "a key names one charge for good: use a new key"
        )
    spent = silos.epsilon_spent(silos.get(session, earlier.silo_id))
    return StartedSearch(search, spent, True, charges.reserve_position(session, earlier.id))


@dataclass(frozen=True)
class SearchQuote:
    trial_epsilon: float
    grid_size: int
    naive_epsilon: float
    searches: list[tuple[TrialDistribution, float]]


def quote(
    trial: AnyMechanism, *, delta: float, mean_trials: float, grid_size: int | None, tnb_shapes: list[float]
) -> SearchQuote:
    """A fixed grid of runs composed beside each random-K search of the same mean (a raw rate is
    fine here: a quote charges nobody)."""
    resolved = charges.resolved_mechanism(trial, silo=None, charged=False, path="trial")
    grid = grid_size if grid_size is not None else math.ceil(mean_trials)
    laws = [distribution(kind, mean=mean_trials) for kind in ("poisson", "geometric", "logarithmic")]
    laws += [distribution("truncated_negative_binomial", mean=mean_trials, shape=eta) for eta in tnb_shapes]
    searched = [search_mechanism(resolved, law) for law in laws]
    for mechanism in searched:  # every law's curve priced before any is computed (a 422 over, at once)
        cost.check(mechanism, path="trial", warm=False)
    cost.check(resolved, path="trial")  # warm: the trial's leaves computed one by one under the guard
    curve = rdp.certified_curve(resolved)

    def epsilon_of(mechanism: RepeatAndSelect) -> float:
        cost.tick()  # each law's curve is a computation of its own
        return rdp.epsilon(rdp.certified_curve(mechanism), delta=delta)[0]  # the curve a search's charge stores

    return SearchQuote(
        trial_epsilon=rdp.epsilon(curve, delta=delta)[0],
        grid_size=grid,
        naive_epsilon=rdp.epsilon(grid * curve, delta=delta)[0],
        searches=[(law, epsilon_of(mechanism)) for law, mechanism in zip(laws, searched, strict=True)],
    )


def get(session: Session, search_id: int, *, silo_scope: int | None = None) -> Search:
    search = session.get(Search, search_id)
    if search is None or (silo_scope is not None and search.silo_id != silo_scope):
        raise NotFound(f"search {search_id} not found")
    return search


def report_trial(
    db: Database, *, search_id: int, score: float, silo_scope: int | None = None, key_id: int | None = None
) -> Search:
    """Record one trial's score (higher is better). The K-th commits the search's charge."""
    with db.write() as session:
        keys.require_live(session, key_id)
        silo_id = get(session, search_id, silo_scope=silo_scope).silo_id
        silos.lock(session, silo_id)
        search = get(session, search_id)
        session.refresh(search)
        if search.trials_reported >= search.trials:
            raise Conflict(
                f"search {search_id} drew K={search.trials} trials and all were reported; no more may run"
            )
        charges.mark_touched(session, silo_id=silo_id, charge_id=search.charge_id)
        search.trials_reported += 1
        if search.best_score is None or score > search.best_score:
            search.best_score = score
        if search.trials_reported == search.trials:
            search.status = SearchStatus.done
    if search.status == SearchStatus.done:
        # After the search row's own transaction: a crash in between leaves the charge reserved,
        # which still counts as spent (the privacy-safe side).
        _commit(db, search.charge_id)
    return search


def _commit(db: Database, charge_id: int) -> None:
    try:
        charges.commit(db, charge_id=charge_id)
    except SettledAlready:
        pass  # committed by an earlier attempt: nothing left to settle

