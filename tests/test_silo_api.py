"""`dpledger.silo` is the public face of a silo's code: its names are pinned here, so that removing
or renaming one is a deliberate change (the way httpx pins its own `__all__`)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import dpledger.silo

PUBLIC = {
    "DPSGDEngine", "Denied", "LedgerClient", "LedgerError", "NotOwned", "OpacusGate", "OpenRound", "Permit",
    "PoissonSampler", "Rejected", "Reservation", "Retry", "RoundGate", "RoundResult", "StepNotCovered",
    "Unreachable", "open_round", "refusal_line", "round_key",
}


def test_the_public_names_are_pinned_and_each_resolves() -> None:
    assert set(dpledger.silo.__all__) == PUBLIC and len(dpledger.silo.__all__) == len(PUBLIC)
    for name in PUBLIC:
        assert getattr(dpledger.silo, name) is not None


def test_the_errors_form_one_tree() -> None:
    from dpledger.silo import Denied, LedgerError, NotOwned, Rejected, Unreachable

    assert all(issubclass(error, LedgerError) for error in (Denied, NotOwned, Rejected, Unreachable))


def test_the_opacus_adapter_loads_only_when_asked_for() -> None:
    code = "import sys, dpledger.silo; print('opacus' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    assert importlib.import_module("dpledger.silo").OpacusGate.__name__ == "OpacusGate"
