"""The registered-size rule: a silo trains on exactly as many records as the ledger holds it registered with.

The ledger believes nothing it can compute itself: it computes a DP-SGD step's q = batch_size /
dataset_size from the size sealed into the silo's record, never from a rate the worker declares. What
it states a silo spent is then the cost of the mechanism that ran only if that size is the number of
records the silo samples from. Fewer records would sample each one at a higher rate than charged
(the guarantee broken); more would charge a q the silo never ran (its ε overstated, and the data is
not the data the silo registered: another file, another split). Both are refused before a round
reserves anything, by the round gate, the Flower silo's mod and `dpledger train` alike.
"""

from __future__ import annotations


class SizeMismatch(ValueError):
    """The records a silo would train on are not as many as its registered dataset_size."""


def size_mismatch(*, registered: int, records: int) -> str | None:
    """Why `records` training records break the rule for a silo registered with `registered`; None if they keep it."""
    if records == registered:
        return None
    effect = "under-charged" if records < registered else "over-charged, for data the silo did not register"
    return (f"the data has {records} training records but the ledger charges as if it had {registered} (dataset_size): "
            f"q would be {effect}; register the silo with dataset_size = {records}")


def check_registered_size(*, registered: int, records: int, silo: str) -> None:
    """Raise `SizeMismatch`, naming `silo`, unless it trains on exactly its registered number of records."""
    reason = size_mismatch(registered=registered, records=records)
    if reason is not None:
        raise SizeMismatch(f"{silo}: {reason}")
