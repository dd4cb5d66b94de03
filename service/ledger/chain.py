"""The hash chain: what each entry's hash covers, and how a stored chain is recomputed.

An entry's hash covers the entry, the immutable fields of its charge (or the silo's budget for the
`create` entry) and the previous hash, so an edit of any stored field shows up on `verify`.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from dpledger.service.store.models import Charge, ChargeRecord, EntryEvent, EntryRecord, LedgerEntry, Silo, SiloRecord
from dpledger.wire import chain_replay
from dpledger.wire.enums import Relation

GENESIS = chain_replay.GENESIS  # the first entry's prev_hash, as every reader of a chain expects it


def timestamp(value: datetime) -> str:
    # SQLite hands datetimes back naive, PostgreSQL aware: hash one canonical UTC spelling.
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.isoformat(timespec="microseconds")


def silo_fields(silo: Silo | SiloRecord) -> dict[str, Any]:
    fields = {
        "id": silo.id,
        "name": silo.name,
        "epsilon": silo.epsilon,
        "delta": silo.delta,
        "dataset_size": silo.dataset_size,
        "created_at": timestamp(silo.created_at),
    }
    # Covered only where it is not the default that every silo before it had, so that their
    # create entries keep the hashes they were written with.
    # (A row read by a migration that predates the column has none: the default, by definition.)
    relation = getattr(silo, "relation", None)
    relation = getattr(relation, "value", relation) or Relation.add_remove.value
    if relation != Relation.add_remove.value:
        fields["relation"] = str(relation)
    return fields


def create_fields(silo: Silo | SiloRecord) -> dict[str, Any]:
    """The create entry covers the budget and, for silos registered with one, the filter (stored
    text, hashed verbatim: an edited or unparsable filter breaks the chain, never the audit); once
    the silo's first charge refit that filter, the registered text kept beside it."""
    fields = silo_fields(silo)
    if silo.filter_seq == 1:
        fields["filter"] = silo.filter_spec
        if silo.registered_filter is not None:  # never so (a refit moves filter_seq off 1): an edit, caught here
            fields["registered_filter"] = silo.registered_filter
    elif silo.registered_filter is not None:  # refit by its first charge (gate.refittable): it covered this
        fields["filter"] = silo.registered_filter
    return fields


def filter_fields(silo: Silo | SiloRecord) -> dict[str, Any]:
    return {"silo_id": silo.id, "filter": silo.filter_spec}


def plan_fields(silo: Silo | SiloRecord) -> dict[str, Any]:
    return {"silo_id": silo.id, "plan": silo.plan}


def seal_fields(silo: Silo | SiloRecord) -> dict[str, Any]:
    """A seal covers the whole record as it stands: an admin accepted it after a tamper (ledger/seals.py)."""
    fields = {**silo_fields(silo), "filter": silo.filter_spec, "plan": silo.plan}
    if silo.registered_filter is not None:  # only where set, so that earlier seals keep their hashes
        fields["registered_filter"] = silo.registered_filter
    return fields


def retire_fields(silo: Silo | SiloRecord) -> dict[str, Any]:
    """A retire entry covers who the silo is (its registered promise, which stays on record) and why an
    admin retired it (ledger/silos.py retire): an edited reason, or a record taken back into service
    under another name or budget, no longer recomputes to it."""
    return {**silo_fields(silo), "reason": silo.retired_reason}


def subject(event: EntryEvent, silo: Silo | SiloRecord, charge: Charge | ChargeRecord | None) -> dict[str, Any]:
    """What an entry of this kind covers besides itself."""
    if event is EntryEvent.create:
        return create_fields(silo)
    if event is EntryEvent.seal:
        return seal_fields(silo)
    if event is EntryEvent.filter:
        return filter_fields(silo)
    if event is EntryEvent.plan:
        return plan_fields(silo)
    if event is EntryEvent.retire:
        return retire_fields(silo)
    if charge is None:
        raise ValueError(f"a {event.value} entry names a charge")
    return charge_fields(charge)


def charge_fields(charge: Charge | ChargeRecord) -> dict[str, Any]:
    return {
        "id": charge.id,
        "silo_id": charge.silo_id,
        "idempotency_key": charge.idempotency_key,
        "request_hash": charge.request_hash,
        "mechanism": charge.mechanism,
        "rdp": charge.rdp,
        "order_grid": charge.order_grid,
        "conversion": charge.conversion,
        "job_id": charge.job_id,
        "round": charge.round,
        "epsilon_spent_after": charge.epsilon_spent_after,
        "created_at": timestamp(charge.created_at),
    }


def canonical(value: Any) -> str:
    """The JSON every hash of the ledger reads: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def entry_hash(entry: LedgerEntry | EntryRecord, *, subject: dict[str, Any] | None = None,
               subject_text: str | None = None) -> str:
    """SHA-256 of the canonical JSON of the entry with its `subject`, or with `subject_text`, the
    subject's canonical JSON where the caller has it: an approval writes the same text into its leaf,
    and it is most of the bytes (a charge's curve). Every other key sorts before "subject", so the
    text is spliced in last: the very bytes of canonical(the whole payload)."""
    if subject_text is None:
        subject_text = canonical(subject)
    head = canonical({
        "silo_id": entry.silo_id,
        "seq": entry.seq,
        "event": str(getattr(entry.event, "value", entry.event)),
        "charge_id": entry.charge_id,
        "epsilon_spent": entry.epsilon_spent,
        "created_at": timestamp(entry.created_at),
        "prev_hash": entry.prev_hash,
    })
    return hashlib.sha256(f'{head[:-1]},"subject":{subject_text}}}'.encode()).hexdigest()
