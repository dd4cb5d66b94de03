"""Where receipts are kept: one folder per ledger (by its log key's id), one file per silo.

    $DPLEDGER_RECEIPTS/
      ledger-<first 16 hex of the log key's id>/
        silo-<id>.jsonl   every receipt of the silo, one JSON line each: the promise as the answer
                          carried it, then the same receipt completed (its log index, a signed head
                          that holds it and the path to that head), appended once the leaf is in the log
        holders           "<silo id> <fingerprint>" of each API key that received the silo's receipts
        head.json         the newest head `dpledger verify --receipts` verified against every one held

One account keeps the receipts of every ledger and silo it ever spoke to in one place, so a check
must first pick the ones of the ledger it talks to (by key id) and of the key it holds (a silo key:
its silo's; an admin's or auditor's: every silo's of that ledger). The holders file is what tells
"this ledger changed its signing key" (receipts this very API key received under another log key)
from "another ledger" (receipts some other key received): a fingerprint, never the API key.

Appends only, never a rewrite: a worker may append while `verify --receipts` reads and completes,
and a line written twice (two processes completing the same receipt) merges on load. Only the
standard library and pydantic: the worker's client writes here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from dpledger.wire.receipts import Receipt, SignedTreeHead

HEAD_FILE = "head.json"
HOLDERS_FILE = "holders"


class StoreError(ValueError):
    """A file in the receipts folder that is not what this module writes."""


def fingerprint(api_key: str) -> str:
    """Names an API key in the holders file without revealing it (domain-separated from the ledger's
    own SHA-256 of the key, so the two never coincide)."""
    return hashlib.sha256(b"dpledger receipts holder\x00" + api_key.encode()).hexdigest()[:32]


def key_id_of(receipt: Receipt) -> str:
    """The log key that signed the receipt (its promise's, else its head's)."""
    signed = receipt.promise if receipt.promise is not None else receipt.tree_head
    assert signed is not None  # Receipt's validator: a promise, an inclusion, or both
    return signed.key_id


def ledger_folder(root: Path, key_id: str) -> Path:
    return root / f"ledger-{key_id[:16]}"


def silo_file(root: Path, key_id: str, silo_id: int) -> Path:
    return ledger_folder(root, key_id) / f"silo-{silo_id}.jsonl"


def append(root: Path, receipts: Iterable[Receipt]) -> None:
    """Appends each receipt to its ledger's and silo's file (one write per file)."""
    lines: dict[Path, list[str]] = {}
    for receipt in receipts:
        lines.setdefault(silo_file(root, key_id_of(receipt), receipt.silo_id), []).append(receipt.model_dump_json() + "\n")
    for path, text in lines.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write("".join(text))


TAIL_BYTES = 64 * 1024  # how far back a client looks for promises an earlier client left uncompleted


def uncompleted_tail(root: Path, key_id: str, silo_id: int) -> list[Receipt]:
    """The promises in the last TAIL_BYTES of the silo's file that no later line completes: what an
    earlier client (a Flower round's, closed before the sequencer logged its commit) left pending.
    A completion is always appended after its promise, so the tail alone decides."""
    path = silo_file(root, key_id, silo_id)
    try:
        with path.open("rb") as file:
            start = max(0, path.stat().st_size - TAIL_BYTES)
            file.seek(start)
            lines = file.read().decode(errors="replace").splitlines()[1 if start else 0:]  # a first line cut short
    except OSError:
        return []
    pending: dict[str, Receipt] = {}
    for line in lines:
        try:
            receipt = Receipt.model_validate_json(line)
        except ValidationError:
            continue
        if receipt.included:
            pending.pop(receipt.leaf_hash, None)
        else:
            pending[receipt.leaf_hash] = receipt
    return list(pending.values())


def add_holder(root: Path, key_id: str, silo_id: int, holder: str) -> None:
    """Notes that the API key with this fingerprint received receipts of `silo_id` under `key_id`."""
    path = ledger_folder(root, key_id) / HOLDERS_FILE
    line = f"{silo_id} {holder}"
    if path.exists() and line in path.read_text().splitlines():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(line + "\n")


def save_head(root: Path, head: SignedTreeHead, public_key: str, budgets: Mapping[int, float] | None = None) -> Path:
    """Keeps `head` as the newest verified head of its ledger (written whole, then renamed), with each
    silo's budget as its signed entries fixed it then (kept from before for silos not checked now)."""
    path = ledger_folder(root, head.key_id) / HEAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = dict(_budgets(path))
    kept.update(budgets or {})
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"public_key": public_key, "head": head.model_dump(),
                                     "budgets": {str(k): v for k, v in sorted(kept.items())}}, indent=2) + "\n")
    temporary.replace(path)
    return path


def _budgets(path: Path) -> dict[int, float]:
    try:
        found = json.loads(path.read_text()).get("budgets", {})
        return {int(k): float(v) for k, v in found.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


@dataclass
class Held:
    """Everything a receipts folder holds, merged: one receipt per entry (its completion where there
    is one), every other head it was completed into, the verified heads and the holders, by key id."""

    receipts: list[Receipt] = field(default_factory=list)
    heads: dict[str, list[SignedTreeHead]] = field(default_factory=dict)  # key id → heads held beside the receipts
    holders: dict[str, set[tuple[int, str]]] = field(default_factory=dict)  # key id → (silo id, fingerprint)
    budgets: dict[str, dict[int, float]] = field(default_factory=dict)  # key id → silo → budget, as last verified

    def key_ids(self) -> set[str]:
        return {key_id_of(r) for r in self.receipts}


def merge(receipts: Iterable[Receipt]) -> tuple[list[Receipt], list[SignedTreeHead]]:
    """One receipt per entry (key, silo, seq, leaf): the promise with the first inclusion found; the
    heads of any other inclusion of the same entry are returned beside (each is checked too)."""
    merged: dict[tuple[str, int, int, str], Receipt] = {}
    extra: list[SignedTreeHead] = []
    for r in receipts:
        key = (key_id_of(r), r.silo_id, r.seq, r.leaf_hash)
        kept = merged.get(key)
        if kept is None:
            merged[key] = r
            continue
        promise = kept.promise or r.promise
        if kept.included and r.included and r.tree_head != kept.tree_head:
            assert r.tree_head is not None
            extra.append(r.tree_head)
        included = kept if kept.included else r
        merged[key] = included.model_copy(update={"promise": promise}) if included.included else kept
    return list(merged.values()), extra


def _receipt_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]


def load(path: Path) -> Held:
    """Every receipt under `path` (a folder, read recursively, or one file: the flat
    `receipts.jsonl` of earlier versions reads too), merged; StoreError names a line that is not one."""
    held = Held()
    raw: list[Receipt] = []
    for file in _receipt_files(path):
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip():
                try:
                    raw.append(Receipt.model_validate_json(line))
                except ValidationError as error:
                    raise StoreError(f"{file}:{number} is not a receipt: {error.errors()[0]['msg']}") from None
    held.receipts, extra = merge(raw)
    for head in extra:
        held.heads.setdefault(head.key_id, []).append(head)
    folders = [path] if not path.is_dir() else [path, *sorted(p for p in path.iterdir() if p.is_dir())]
    for folder in folders:
        head_file = folder / HEAD_FILE
        if head_file.is_file():
            try:
                head = SignedTreeHead.model_validate(json.loads(head_file.read_text())["head"])
            except (ValueError, KeyError, TypeError) as error:
                raise StoreError(f"{head_file} is not a head that `dpledger verify --receipts` kept: {error}") from None
            held.heads.setdefault(head.key_id, []).append(head)
            held.budgets.setdefault(head.key_id, {}).update(_budgets(head_file))
        holders = folder / HOLDERS_FILE
        if holders.is_file():
            for line in holders.read_text().splitlines():
                silo, _, holder = line.partition(" ")
                if silo.isdigit() and holder:
                    for key_id in _folder_key_ids(folder, held):
                        held.holders.setdefault(key_id, set()).add((int(silo), holder))
    return held


def _folder_key_ids(folder: Path, held: Held) -> set[str]:
    """The full key ids a `ledger-<prefix>` folder stands for (those of the receipts held)."""
    prefix = folder.name.removeprefix("ledger-")
    return {k for k in held.key_ids() if k.startswith(prefix)} if folder.name.startswith("ledger-") else set()
