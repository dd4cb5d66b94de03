"""What a check of the transparency log found, as every part of the check adds to it: the problems
(misbehaviour), the proofs a third party can check, what could not be asked, and what it verified
(today's head, the promises found in the log, each silo's budget). A check is handed the ledger as a
`Get`, so that a test or a bench hands it another way to ask."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpledger.wire.receipts import Receipt, SignedTreeHead

Get = Callable[[str, dict[str, Any] | None], Any]  # path, query → the JSON body; raises on an error status


@dataclass
class Outcome:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    evidence: list[dict[str, Any]] = field(default_factory=list)  # proofs of misbehaviour, as printed
    head: SignedTreeHead | None = None  # the current head, once verified
    unasked: list[str] = field(default_factory=list)  # what could not be asked (exit 2 unless there is a finding)
    completions: list[Receipt] = field(default_factory=list)  # promises found in the log, with their inclusion
    budgets: dict[int, float] = field(default_factory=dict)  # each silo's ε budget as its signed entries fix it

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unasked

    def fork(self, a: SignedTreeHead, b: SignedTreeHead, public_key: bytes, why: str) -> None:
        self.problems.append(why)
        self.evidence.append({"misbehaviour": why, "public_key": public_key.hex(),
                              "heads": [a.model_dump(), b.model_dump()]})
