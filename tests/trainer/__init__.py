"""Tests of the worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpledger.wire.mechanisms import AnyMechanism


def wire(mechanisms: Sequence[AnyMechanism | None]) -> list[dict[str, Any] | None]:
    """Declared mechanisms as the JSON the ledger receives, to compare with literal dicts."""
    return [None if m is None else m.model_dump(mode="json", exclude_none=True) for m in mechanisms]
