"""Gate an unmodified Opacus `PrivacyEngine` loop: a registered accountant that refuses unreserved steps.

    import dpledger.trainer.silo.opacus_gate as ledger_opacus          # registers the "dpledger" accountant
    engine = PrivacyEngine(accountant=ledger_opacus.ACCOUNTANT)
    model, optimizer, loader = engine.make_private(module=..., optimizer=..., data_loader=..., ...)
    gate = ledger_opacus.OpacusGate(client, silo_id=..., privacy_engine=engine, module=model,
                                    optimizer=optimizer, data_loader=loader)
    for r in range(rounds):
        with gate.round(steps=len(loader)):
            for x, y in loader: ...                              # the loop as it was

Opacus calls the accountant from `DPOptimizer.pre_step`, after clipping and noise but before
`original_optimizer.step()` (opacus/optimizers/optimizer.py, 1.6): an accountant whose `step()`
raises stops the update before any parameter moves. `LedgerAccountant.step` raises
`StepNotCovered` unless the gate's open round covers that step (its count, its σ, its q), and
otherwise records it as Opacus' own RDP accountant does, so `PrivacyEngine.get_epsilon` still
reports Opacus' view of the steps that ran.

The ledger charges only what it can prove. Opacus accounts every loop as Poisson-sampled with
q = 1/len(loader), even with `poisson_sampling=False` where it shuffles fixed-size batches (Opacus
issue #80); the gate accepts only Opacus' `DPDataLoader` over a `UniformWithReplacementSampler`,
which does sample each record independently with q, and records that it did. It declares the
smallest batch size B with B/n ≥ q, so the ledger's q = B/n (from the registered n) is at least the
loader's, and above it by less than 1/n.
"""

from __future__ import annotations

import math
from typing import Any

from opacus.accountants import RDPAccountant, register_accountant
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from opacus.privacy_engine import PrivacyEngine
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn
from torch.utils.data import DataLoader

from dpledger.trainer.silo.gate import OpenRound, RoundGate, StepNotCovered
from dpledger.wire.client import LedgerClient
from dpledger.wire.mechanisms import DpSgd

ACCOUNTANT = "dpledger"
POISSON = "poisson"


class LedgerAccountant(RDPAccountant):  # type: ignore[misc]  # opacus ships no type information
    """Opacus' RDP accountant whose `step()` refuses any step that no open reservation covers."""

    def __init__(self) -> None:
        super().__init__()
        self.permit: OpenRound | None = None

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        if self.permit is None:
            raise StepNotCovered("no round is open: wrap the loop's steps in `with gate.round(...)`")
        self.permit.take(noise_multiplier=noise_multiplier, sampling_rate=sample_rate)
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    @classmethod
    def mechanism(cls) -> str:
        return ACCOUNTANT


register_accountant(ACCOUNTANT, LedgerAccountant, force=True)


class NotPoisson(ValueError):
    """A loader whose sampling the ledger cannot prove: refused rather than charged as Poisson."""


class OpacusPoissonSampler:
    """What an Opacus `DPDataLoader` samples, as the gate's sampler: Poisson with the loader's q."""

    kind = POISSON

    def __init__(self, data_loader: DataLoader[Any]) -> None:
        if not isinstance(data_loader, DPDataLoader) or not isinstance(data_loader.batch_sampler, UniformWithReplacementSampler):
            raise NotPoisson(
                f"the loader is a {type(data_loader).__name__} over a {type(data_loader.batch_sampler).__name__}, not "
                "Opacus' Poisson DPDataLoader: Opacus would account it as Poisson anyway (Opacus #80), the ledger "
                "charges only what it can prove; call make_private(..., poisson_sampling=True)"
            )
        self.dataset_size = len(data_loader.dataset)
        self.loader_sampling_rate = float(data_loader.sample_rate)
        # The smallest B with B/n >= q: the ledger's q = B/n then covers the loader's.
        self.batch_size = max(1, math.ceil(self.loader_sampling_rate * self.dataset_size))
        if self.batch_size / self.dataset_size < self.loader_sampling_rate:
            self.batch_size += 1  # ceil of a rounded product can land one short

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.dataset_size

    def dpsgd(self, *, noise_multiplier: float, steps: int) -> DpSgd:
        return DpSgd(batch_size=self.batch_size, noise_multiplier=float(noise_multiplier), steps=int(steps))


class OpacusGate(RoundGate):
    """The round gate over an Opacus loop: rounds are reserved at the optimizer's σ, and the
    engine's accountant takes each step's permit from the open round."""

    def __init__(self, client: LedgerClient, *, silo_id: int, privacy_engine: PrivacyEngine, module: nn.Module,
                 optimizer: DPOptimizer, data_loader: DataLoader[Any], job_id: str | None = None) -> None:
        accountant = privacy_engine.accountant
        if not isinstance(accountant, LedgerAccountant):
            raise ValueError(
                f"the PrivacyEngine's accountant is {type(accountant).__name__}; create it with "
                f"PrivacyEngine(accountant={ACCOUNTANT!r}) so that unreserved steps are refused"
            )
        self.accountant: LedgerAccountant = accountant
        self.optimizer = optimizer
        super().__init__(client, silo_id=silo_id, sampler=OpacusPoissonSampler(data_loader), job_id=job_id)
        # The model running inside a round reads the silo's data: from then on the round's charge
        # is committed even if the body raises before a step.
        module.register_forward_pre_hook(self._mark_touched)

    def _mark_touched(self, *_: object) -> None:
        if self.accountant.permit is not None:
            self.accountant.permit.touch()

    def _opened(self, permit: OpenRound) -> None:
        self.accountant.permit = permit

    def _closed(self, permit: OpenRound) -> None:
        self.accountant.permit = None

    def default_noise_multiplier(self) -> float:
        return float(self.optimizer.noise_multiplier)
