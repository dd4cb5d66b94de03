"""The records that cross the wire between the ServerApp and a silo, and the state a silo keeps.

A silo answers every train message with one of four constant statuses and nothing else that could
depend on its budget: a refusal is "declined" whatever the silo has left, so the server learns that
a silo stopped, never by how much.
"""

from __future__ import annotations

from typing import Final

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

TRAINED: Final = "trained"
DECLINED: Final = "declined"  # over budget: the silo spends no more in this run
REPLAYED: Final = "replayed"  # this round was already approved once: it never trains twice
FAILED: Final = "failed"  # the silo could not run the round (its own log says why)
STATUSES: Final = (TRAINED, DECLINED, REPLAYED, FAILED)

# Keys of the train message (server → silo): the model and the round's public hyperparameters.
ARRAYS: Final = "arrays"
CONFIG: Final = "config"
STATUS: Final = "status"
METRICS: Final = "metrics"

# Keys in a silo's own Context.state (never sent): the mod's approval for the round in progress and
# what the round reports back to the mod. The silo half's own state lies in its state folder.
APPROVAL: Final = "dpledger-approval"
OUTCOME: Final = "dpledger-outcome"


def status_reply(message: Message, status: str) -> Message:
    """A reply that says only `status` (one of STATUSES)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}. Found {status!r}.")
    return Message(RecordDict({STATUS: ConfigRecord({STATUS: status})}), reply_to=message)


def reply_status(message: Message) -> str:
    """The status of a silo's reply; an error reply (a crash in the ClientApp) counts as failed."""
    if message.has_error() or STATUS not in message.content.config_records:
        return FAILED
    status = message.content.config_records[STATUS].get(STATUS)
    return status if isinstance(status, str) and status in STATUSES else FAILED


def trained_reply(message: Message, upload: ArrayRecord, metrics: dict[str, float]) -> Message:
    return Message(
        RecordDict({STATUS: ConfigRecord({STATUS: TRAINED}), ARRAYS: upload, METRICS: MetricRecord(dict(metrics))}),
        reply_to=message,
    )
