"""Private hyperparameter searches (paper 000 §7; Papernot & Steinke 2022; DESIGN.md).

A search is ONE `repeat_and_select` charge over the trial mechanism, reserved up front through
`charges.reserve` (same lock, same idempotency, same refusal: an over-budget search writes nothing
and no trial runs). Only after the approval does the service draw K, so the protocol the accounting
assumes is the one that runs. Trials are then reported one by one; a (K+1)-th is refused, and the
K-th commits the charge.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dpledger.service.accounting.trial_counts import TrialDistribution, draw_trials
from dpledger.service.ledger import charges, silos, transparency
from dpledger.service.ledger.db import write_transaction
from dpledger.service.ledger.errors import Conflict, NotFound, SettledAlready
from dpledger.service.ledger.models import Search, SearchStatus
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
    factory: sessionmaker[Session],
    *,
    silo_id: int,
    trial: AnyMechanism,
    law: TrialDistribution,
    idempotency_key: str,
) -> StartedSearch:
    reservation = charges.reserve(
        factory, silo_id=silo_id, mechanism=search_mechanism(trial, law), idempotency_key=idempotency_key
    )
    with factory() as session:
        earlier = _by_charge(session, reservation.charge_id)
    if earlier is not None:
        return StartedSearch(earlier, reservation.epsilon_spent, True, reservation.position)

    # Drawn only now that the charge is approved: a refused search never learns a K.
    trials = draw_trials(law)
    try:
        with write_transaction(factory) as session:
            silos.lock(session, silo_id)
            search = Search(
                silo_id=silo_id, charge_id=reservation.charge_id, trial_mechanism=trial.model_dump_json(),
                distribution=law.kind, shape=str(law.shape), mean_trials=law.mean, trials=trials,
                trials_reported=0, best_score=None,
                status=SearchStatus.done if trials == 0 else SearchStatus.running, created_at=datetime.now(UTC),
            )
            session.add(search)
    except IntegrityError:
        # A concurrent retry with the same key stored its search first: that one (and its K) stands.
        with factory() as session:
            winner = _by_charge(session, reservation.charge_id)
        assert winner is not None
        return StartedSearch(winner, reservation.epsilon_spent, True, reservation.position)
    if trials == 0:
        # Poisson K = 0 (Papernot & Steinke, Thm 6): the search released "no result", and that
        # release is what the charge paid for; nothing is left to run.
        _commit(factory, reservation.charge_id)
    return StartedSearch(search, reservation.epsilon_spent, reservation.replayed, reservation.position)


def get(session: Session, search_id: int) -> Search:
    search = session.get(Search, search_id)
    if search is None:
        raise NotFound(f"search {search_id} not found")
    return search


def report_trial(factory: sessionmaker[Session], *, search_id: int, score: float) -> Search:
    """Record one trial's score (higher is better). The K-th commits the search's charge."""
    with factory() as session:
        silo_id = get(session, search_id).silo_id
    with write_transaction(factory) as session:
        silos.lock(session, silo_id)
        search = get(session, search_id)
        if search.trials_reported >= search.trials:
            raise Conflict(
                f"search {search_id} drew K={search.trials} trials and all were reported; no more may run"
            )
        search.trials_reported += 1
        if search.best_score is None or score > search.best_score:
            search.best_score = score
        if search.trials_reported == search.trials:
            search.status = SearchStatus.done
    if search.status == SearchStatus.done:
        # After the search row's own transaction: a crash in between leaves the charge reserved,
        # which still counts as spent (the privacy-safe side, STYLE.md).
        _commit(factory, search.charge_id)
    return search


def _commit(factory: sessionmaker[Session], charge_id: int) -> None:
    try:
        charges.commit(factory, charge_id=charge_id)
    except SettledAlready:
        pass  # committed by an earlier attempt (or released by its silo): nothing left to settle


def _by_charge(session: Session, charge_id: int) -> Search | None:
    return session.scalars(select(Search).where(Search.charge_id == charge_id)).one_or_none()
