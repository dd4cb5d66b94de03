"""Comparing a replayed answer with the first one."""

from __future__ import annotations

from typing import Any

INCLUDED = ("log_index", "tree_head", "inclusion_path")


def without_inclusion(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer with its receipt's inclusion left out. A replay answers the first answer's receipt
    (the same promise, leaf and entry) with the inclusion in the log it may have gained since: the
    log's sequencer runs 0.1–1 s after an approval, so it can land between the two requests."""
    receipt = answer.get("receipt")
    if receipt is None:
        return answer
    return {**answer, "receipt": {k: v for k, v in receipt.items() if k not in INCLUDED}}


def gained_or_kept_inclusion(first: dict[str, Any], again: dict[str, Any]) -> bool:
    """An inclusion is never lost between two answers: if the first had one, the replay has it too."""
    return first["receipt"]["log_index"] is None or again["receipt"]["log_index"] == first["receipt"]["log_index"]
