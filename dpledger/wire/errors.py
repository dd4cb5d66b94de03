"""The one tree of client-side errors: everything the ledger said no to, or failed to say.

- `LedgerError`: the base; catch it to stop on anything the ledger did.
- `Denied`: over budget. Final, never retried; carries the refusal's numbers.
- `Rejected`: any other 4xx (bad request, wrong key, a conflict): a bug or a policy on our side,
  never retried. Carries the status, the body and the request (method and path) it answers.
- `Unreachable`: connection errors, timeouts and 5xx, after the client's bounded retries; the last
  5xx's status and body when there was one.
- `NotOwned`: the round protocol's refusal to train on a reservation this attempt did not make.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpledger.wire.schemas import OverBudgetResponse

if TYPE_CHECKING:  # the client imports this module; a Reservation is only named here
    from dpledger.wire.client import Reservation


class LedgerError(Exception):
    """Anything the ledger said or failed to say."""


class Denied(LedgerError):
    """Over budget: final. The silo stops spending."""

    def __init__(self, *, epsilon: float, epsilon_spent: float | None, epsilon_if_approved: float | None, detail: str,
                 epsilon_dp_accounting: float | None = None) -> None:
        super().__init__(detail)
        self.epsilon = epsilon
        self.epsilon_spent = epsilon_spent
        self.epsilon_if_approved = epsilon_if_approved  # the gate's reading: what the ledger would charge
        self.epsilon_dp_accounting = epsilon_dp_accounting  # dp-accounting's of the same charges, for reference

    @classmethod
    def from_response(cls, refusal: OverBudgetResponse) -> Denied:
        return cls(epsilon=refusal.epsilon, epsilon_spent=refusal.epsilon_spent,
                   epsilon_if_approved=refusal.epsilon_if_approved, detail=refusal.detail,
                   epsilon_dp_accounting=refusal.epsilon_dp_accounting)


class Rejected(LedgerError):
    """A 4xx other than a denial (bad request, wrong key, conflict): never retried. `body` is the
    parsed JSON (or the text) of the answer; `method` and `path` the request it answers."""

    def __init__(self, status_code: int, body: Any, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{status_code}: {body}")
        self.status_code = status_code
        self.body = body
        self.method = method
        self.path = path


class Unreachable(LedgerError):
    """The service did not answer within the retry bound: stop without spending. `last` says how the
    last attempt failed; `status_code` and `body` are its answer's when it was a 5xx (None when
    nothing answered at all)."""

    def __init__(self, message: str, *, last: str = "", status_code: int | None = None, body: Any = None,
                 path: str = "") -> None:
        super().__init__(message)
        self.last = last or message
        self.status_code = status_code
        self.body = body
        self.path = path


class NotOwned(LedgerError):
    """The round's key names a charge this attempt did not make (another delivery's reservation, or a
    settled charge): the body never runs, and the charge stays as it is."""

    def __init__(self, reservation: Reservation, *, round: int) -> None:
        held = "another attempt" if reservation.attempt_id else "an attempt that sent no id"
        super().__init__(
            f"round {round + 1}: charge {reservation.charge_id} ({reservation.status.value}) was reserved before by {held}; "
            "this attempt does not train on it"
        )
        self.reservation = reservation
