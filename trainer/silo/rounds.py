"""The one round protocol of every silo-side runner: reserve → train → settle.

The library's round gate (`trainer/silo/gate.py`), the in-process simulator's loop (`trainer/loop.py`)
and the Flower ClientApp's mod (`dpledger/flower/gate.py`) open and settle their rounds here, and
nowhere else:

- **One idempotency key** per (job, round, silo): `round_key`. A retry, a restart or a redelivery
  of the same round names the same charge, so the ledger charges it once.
- **Only the owner trains.** `open_round` returns a `Permit` only for a reservation this very
  attempt made (`Reservation.owned`: the ledger answers the attempt id it stored with the charge).
  A replay of another attempt's reservation, or of a settled charge, raises `NotOwned` before the
  body starts. That charge is left as it is: a reserved one stays spent (its owner may have read
  the data) until an operator settles it (`dpledger charges list --open`).
- **One settle rule.** Commit whenever the body may have touched the data (`Permit.touch`, or a
  body that ran to its end); release only when it provably did not. A release the ledger refuses
  (the round already reported an output) commits; a settlement that cannot reach the ledger
  leaves the charge reserved, which the ledger counts as spent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from dpledger.wire.client import LedgerClient, Reservation
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Denied, LedgerError, NotOwned, Rejected
from dpledger.wire.mechanisms import AnyMechanism
from dpledger.wire.schemas import SiloDetail


def round_key(job_id: str, round: int, silo_id: int, charge: int = 0) -> str:
    """The idempotency key of a silo's round in a job: the same for every attempt at that round.
    `charge` > 0 names a further charge of the round: a resumed job (`dpledger train --resume`, or a
    Flower run resumed: its start's number) trains again, under a charge of its own, a round whose
    earlier charge was spent without a checkpoint of it."""
    key = f"{job_id}/round-{round}/silo-{silo_id}"
    return key if charge == 0 else f"{key}/charge-{charge}"


def _epsilon(value: float | None) -> str:
    return "inf" if value is None else f"{value:.2f}"


def refusal_line(denied: Denied, *, round: int) -> str:
    """One line with the refusal's numbers, e.g. "round 3 refused: it needs ε 5.46 in all; …". `round` is the
    index the ledger keeps (from 0); people read rounds from 1, as the progress bars and plots count them.
    ε is the gate's reading (what the ledger charges), dp-accounting's of the same charges beside it."""
    reference = "" if denied.epsilon_dp_accounting is None else (
        f" (the gate's reading; dp-accounting's non-adaptive ε of the same charges, for reference: "
        f"{denied.epsilon_dp_accounting:.2f})"
    )
    return (f"round {round + 1} refused: it needs ε {_epsilon(denied.epsilon_if_approved)} in all{reference}; "
            f"the budget is {denied.epsilon:.2f} and {_epsilon(denied.epsilon_spent)} is spent")


def spent_line(detail: SiloDetail, *, round: int) -> str:
    """What a silo's log says once a round is settled: its ε as the ledger charges it (the gate's
    reading), dp-accounting's of the same charges beside it, for reference."""
    return (f"round {round + 1} settled: ε spent {_epsilon(detail.epsilon_spent)} of {detail.epsilon:.2f} (the gate's "
            f"reading, what the ledger charges; dp-accounting's non-adaptive ε of the same charges, for reference: "
            f"{_epsilon(detail.epsilon_dp_accounting)})")


@dataclass
class Permit:
    """An owned reservation of one round, and whether the body may have touched the data yet."""

    client: LedgerClient
    silo_id: int
    job_id: str
    round: int
    reservation: Reservation
    touched: bool = False
    status: ChargeStatus | None = None  # once settled
    epsilon_spent: float | None = None  # the silo's ε after the settlement (None: an earlier attempt settled it)

    @property
    def charge_id(self) -> int:
        return self.reservation.charge_id

    def touch(self) -> None:
        """The body is about to read the silo's data (or may have): from now on only a commit settles it."""
        self.touched = True

    def settle(self) -> ChargeStatus:
        """Commit if touched, else release. Settles once; raises LedgerError when the ledger cannot be
        reached (the charge then stays reserved: spent)."""
        if self.status is not None:
            return self.status
        if self.touched:
            self.epsilon_spent = self.client.commit(self.charge_id)
            self.status = ChargeStatus.committed
            return self.status
        try:
            self.epsilon_spent = self.client.release(self.charge_id)
            self.status = ChargeStatus.released
        except Rejected:
            # The ledger knows better (an output of the round reached it): keep it spent.
            self.epsilon_spent = self.client.commit(self.charge_id)
            self.status = ChargeStatus.committed
        return self.status

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None) -> None:
        if error is None:
            self.touch()  # a body that ran to its end may have read anything: nothing proves it did not
            self.settle()
            return
        try:
            self.settle()
        except LedgerError as settle_error:
            error.add_note(f"the round's charge {self.charge_id} stays reserved (spent): {settle_error}")


def open_round(
    client: LedgerClient, *, silo_id: int, job_id: str, round: int, mechanism: AnyMechanism | Mapping[str, Any],
    charge: int = 0,
) -> Permit:
    """Reserve the round's mechanism under its one key (`round_key`, with `charge`); a Permit only for
    this attempt's own reservation. Raises Denied (over budget: final for the silo), NotOwned, or
    another LedgerError."""
    reservation = client.reserve(
        silo_id, mechanism=mechanism, idempotency_key=round_key(job_id, round, silo_id, charge), job_id=job_id,
        round=round,
    )
    if not reservation.owned:
        raise NotOwned(reservation, round=round)
    return Permit(client, silo_id, job_id, round, reservation)
