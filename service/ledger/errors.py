"""Domain errors of the ledger; the HTTP layer maps each to one status code."""

from __future__ import annotations


class LedgerError(Exception):
    pass


class NotFound(LedgerError):
    pass


class Unauthorized(LedgerError):
    """The caller's key was revoked (or never was) by the time its write transaction began."""


class Conflict(LedgerError):
    """A request that cannot apply in the current state (settled twice, name taken…)."""


class SettledAlready(Conflict):
    """Commit or release of a charge that is no longer reserved; `status` says what it is."""

    def __init__(self, charge_id: int, status: str) -> None:
        super().__init__(f"charge {charge_id} is {status}, not reserved")
        self.status = status


class InvalidRequest(LedgerError):
    """A well-formed request that is wrong in context; `field` names where (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class OverBudget(LedgerError):
    """`epsilon_dp_accounting`: dp-accounting's non-adaptive ε of the same charges (its RDP
    conversion at the best order, whole δ), shown beside the gate's reading for reference only."""

    def __init__(
        self, *, budget: float, epsilon_spent: float, epsilon_if_approved: float, epsilon_dp_accounting: float | None = None
    ) -> None:
        reference = "" if epsilon_dp_accounting is None else (
            f"; for reference, dp-accounting's non-adaptive RDP ε of the same charges: {epsilon_dp_accounting:.6g} "
            "(not a bound under adaptive choices)"
        )
        super().__init__(
            f"over budget: approving would spend ε={epsilon_if_approved:.6g} by the gate's reading, budget "
            f"ε={budget:.6g} (already spent {epsilon_spent:.6g}){reference}"
        )
        self.budget = budget
        self.epsilon_spent = epsilon_spent
        self.epsilon_if_approved = epsilon_if_approved
        self.epsilon_dp_accounting = epsilon_dp_accounting
