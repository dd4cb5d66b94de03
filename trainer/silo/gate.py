"""The round gate: a silo's training loop spends privacy only inside a reservation the ledger approved.

    gate = RoundGate(client, silo_id=silo_id, sampler=engine.sampler)
    with gate.round(steps=20, noise_multiplier=sigma) as permit:
        for _ in range(permit.steps):
            engine.step(permit)

On entry the gate opens the round through the one round protocol (`trainer/silo/rounds.py`): it reserves
the round's mechanism (the one its sampler declares: `steps` Poisson-sampled Gaussian steps at the
sampler's batch size; the ledger derives q from the silo's registered size). The body runs only on
this attempt's own reservation: a denial (`Denied`, final: the gate refuses every later round too)
or a charge this attempt did not make (`NotOwned`: the round was reserved before, here or in another
process) raises before the body starts. Every step asks the permit first; a step beyond the
reservation, at less noise or at a higher sampling rate is refused (`StepNotCovered`) before it reads
a record. On exit the protocol's settle rule applies: committed once the body may have touched data
(a step was permitted, the model ran, or the body ran to its end), released only when it never did.

The gate first reads the silo's registered dataset size and refuses a sampler drawing from a
different number of records (`registered.check_registered_size`, the one rule every runner applies):
q = batch_size / n is charged with the ledger's n.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from dpledger.trainer.silo.registered import check_registered_size
from dpledger.trainer.silo.rounds import Permit, open_round, round_key
from dpledger.wire.client import LedgerClient
from dpledger.wire.enums import ChargeStatus
from dpledger.wire.errors import Denied
from dpledger.wire.mechanisms import DpSgd
from dpledger.wire.schemas import SiloCalibration, SiloDetail

# A permitted step's noise may not be below the reserved σ nor its sampling rate above the reserved
# q; equality is tested with this relative slack so a float that went through JSON still matches.
_SLACK = 1e-12


class StepNotCovered(RuntimeError):
    """A step that no open reservation covers: refused before it reads a record or moves a parameter."""


class DeclaresDpSgd(Protocol):
    """A sampler that draws the batches and declares the mechanism they imply. `kind` names how it
    samples ("poisson": each record independently with q), which is what the `dpsgd` charge means."""

    @property
    def kind(self) -> str: ...

    @property
    def dataset_size(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def sampling_rate(self) -> float: ...

    def dpsgd(self, *, noise_multiplier: float, steps: int) -> DpSgd: ...


@dataclass
class OpenRound:
    """The permit of one reserved round: what it covers, and what the body has taken of it."""

    permit: Permit
    steps: int
    noise_multiplier: float
    sampling_rate: float
    steps_taken: int = 0
    closed: bool = False

    @property
    def round(self) -> int:
        return self.permit.round

    @property
    def charge_id(self) -> int:
        return self.permit.charge_id

    @property
    def touched(self) -> bool:
        return self.permit.touched

    def touch(self) -> None:
        """Mark that the body read the silo's data (the round's charge can no longer be released)."""
        self.permit.touch()

    def take(self, *, noise_multiplier: float | None = None, sampling_rate: float | None = None) -> float:
        """Permit one step, or raise `StepNotCovered`. Returns the reserved noise multiplier."""
        if self.closed:
            raise StepNotCovered(f"round {self.round} is closed: no reservation covers a step outside its `with` block")
        if self.steps_taken >= self.steps:
            raise StepNotCovered(f"round {self.round} reserved {self.steps} steps; step {self.steps_taken + 1} is not covered")
        if noise_multiplier is not None and not noise_multiplier >= self.noise_multiplier * (1 - _SLACK):
            raise StepNotCovered(
                f"round {self.round} reserved noise_multiplier={self.noise_multiplier!r}; "
                f"a step at {noise_multiplier!r} is not covered"
            )
        if sampling_rate is not None and not sampling_rate <= self.sampling_rate * (1 + _SLACK):
            raise StepNotCovered(
                f"round {self.round} reserved sampling rate {self.sampling_rate!r}; a step at {sampling_rate!r} is not covered"
            )
        self.steps_taken += 1
        self.permit.touch()
        return self.noise_multiplier


@dataclass(frozen=True)
class RoundResult:
    round: int
    charge_id: int
    steps_reserved: int
    steps_taken: int
    noise_multiplier: float
    status: ChargeStatus
    sampler: str  # how the round's batches were drawn ("poisson"), as the charged mechanism assumes
    epsilon_spent: float | None  # the silo's ε after the settlement; None where an earlier attempt had settled it
    error: str | None = None  # the body's exception, where it raised


class RoundGate:
    """Reserve → train → commit around each round of a silo's own training loop."""

    def __init__(self, client: LedgerClient, *, silo_id: int, sampler: DeclaresDpSgd, job_id: str | None = None) -> None:
        self.client, self.silo_id, self.sampler = client, silo_id, sampler
        # A fresh job id per gate unless one is given: re-running a script with the same job_id
        # replays its rounds (and trains on none of them); a new one asks for new rounds.
        self.job_id = job_id if job_id is not None else f"gate-{secrets.token_hex(6)}"
        if sampler.kind != "poisson":
            raise ValueError(f"the sampler samples {sampler.kind!r}; a dpsgd charge means Poisson sampling, so it is refused")
        self.registered: SiloDetail = client.silo(silo_id)
        check_registered_size(registered=self.registered.dataset_size, records=sampler.dataset_size, silo=f"silo {silo_id}")
        self.results: list[RoundResult] = []
        self._next_round = 0
        self._denied: Denied | None = None

    def calibrate(self, *, rounds: int, steps_per_round: int) -> SiloCalibration:
        """The smallest σ (rounded up) with which `rounds` more rounds fit what the silo has left."""
        return self.client.calibrate_silo(
            self.silo_id, batch_size=self.sampler.batch_size, steps_per_round=steps_per_round, rounds=rounds
        )

    def mechanism(self, *, steps: int, noise_multiplier: float) -> DpSgd:
        return self.sampler.dpsgd(noise_multiplier=noise_multiplier, steps=steps)

    def idempotency_key(self, round: int) -> str:
        return round_key(self.job_id, round, self.silo_id)

    # Hooks for adapters (the Opacus gate attaches the permit to its accountant).
    def _opened(self, permit: OpenRound) -> None:
        pass

    def _closed(self, permit: OpenRound) -> None:
        pass

    def default_noise_multiplier(self) -> float:
        """σ of a round that names none (an adapter reads it off its optimizer)."""
        raise ValueError("noise_multiplier is required: the round's σ (see calibrate())")

    @contextmanager
    def round(self, *, steps: int, noise_multiplier: float | None = None, round: int | None = None) -> Iterator[OpenRound]:
        """Reserve `steps` steps at σ = noise_multiplier, run the body on a fresh reservation, settle."""
        if noise_multiplier is None:
            noise_multiplier = self.default_noise_multiplier()
        if self._denied is not None:
            raise self._denied  # final: the ledger refused this silo once, and its budget only grows spent
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1. Found {steps!r}.")
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"noise_multiplier must be finite and > 0. Found {noise_multiplier!r}.")
        index = self._next_round if round is None else round
        try:
            opened = open_round(self.client, silo_id=self.silo_id, job_id=self.job_id, round=index,
                                mechanism=self.mechanism(steps=steps, noise_multiplier=noise_multiplier))
        except Denied as denied:
            self._denied = denied
            raise
        self._next_round = index + 1
        permit = OpenRound(
            permit=opened, steps=steps, noise_multiplier=noise_multiplier,
            sampling_rate=self.sampler.batch_size / self.registered.dataset_size,
        )
        self._opened(permit)
        error: BaseException | None = None
        try:
            with opened:
                try:
                    yield permit
                except BaseException as raised:
                    error = raised
                    raise
                finally:
                    permit.closed = True
                    self._closed(permit)
        finally:
            if opened.status is not None:
                self.results.append(RoundResult(
                    round=index, charge_id=opened.charge_id, steps_reserved=steps, steps_taken=permit.steps_taken,
                    noise_multiplier=noise_multiplier, status=opened.status, sampler=self.sampler.kind,
                    epsilon_spent=opened.epsilon_spent, error=None if error is None else f"{type(error).__name__}: {error}",
                ))
