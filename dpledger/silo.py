"""What a silo's own training code imports: the round gate, the one round protocol, the DP-SGD
engine, the Opacus adapter and the ledger's typed client with its errors.

    from dpledger.silo import DPSGDEngine, LedgerClient, RoundGate

Everything listed in `__all__` is the public face (tests/test_silo_api.py pins it, as httpx pins
its own); anything reached by a longer path may move. The Opacus adapter loads on first use, so a
silo without the `opacus` extra can import the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpledger.trainer.silo.dpsgd.engine import DPSGDEngine
from dpledger.trainer.silo.dpsgd.sampler import PoissonSampler
from dpledger.trainer.silo.gate import OpenRound, RoundGate, RoundResult, StepNotCovered
from dpledger.trainer.silo.rounds import Permit, open_round, refusal_line, round_key
from dpledger.wire.client import LedgerClient, Reservation, Retry
from dpledger.wire.errors import Denied, LedgerError, NotOwned, Rejected, Unreachable

if TYPE_CHECKING:
    from dpledger.trainer.silo.opacus_gate import OpacusGate

__all__ = [
    "DPSGDEngine",
    "Denied",
    "LedgerClient",
    "LedgerError",
    "NotOwned",
    "OpacusGate",
    "OpenRound",
    "Permit",
    "PoissonSampler",
    "Rejected",
    "Reservation",
    "Retry",
    "RoundGate",
    "RoundResult",
    "StepNotCovered",
    "Unreachable",
    "open_round",
    "refusal_line",
    "round_key",
]


def __getattr__(name: str) -> Any:
    if name == "OpacusGate":  # needs the `opacus` extra; imported only when asked for
        from dpledger.trainer.silo.opacus_gate import OpacusGate

        return OpacusGate
    raise AttributeError(f"module 'dpledger.silo' has no attribute {name!r}")
