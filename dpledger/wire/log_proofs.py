"""Many proofs of the transparency log in one answer: what a silo checking its receipts asks for.

A silo holding a hundred receipts needs an inclusion proof for each of its entries and a consistency
proof from each distinct head it holds to the log's current one; asked one request each, that is
hundreds of round trips. GET /v1/log/proofs answers them together, against one tree size.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from dpledger.wire.receipts import ConsistencyProof, InclusionProof

MAX_PROOFS = 500  # of each kind per request: the comma-separated lists stay well inside a URL's limits


class LogProofs(BaseModel):
    tree_size: int = Field(description="the size every proof is against")
    inclusion: list[InclusionProof] = Field(description="one per index asked, in the order asked")
    consistency: list[ConsistencyProof] = Field(description="one per first size asked, in the order asked")
