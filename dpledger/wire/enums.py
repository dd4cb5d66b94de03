"""The ledger's vocabularies, shared by its tables and its wire models."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    admin = "admin"
    silo = "silo"
    auditor = "auditor"
    coordinator = "coordinator"


class ChargeStatus(enum.StrEnum):
    reserved = "reserved"
    committed = "committed"
    released = "released"


class EntryEvent(enum.StrEnum):
    create = "create"  # the silo's budget itself, so an edited budget breaks the chain
    reserve = "reserve"
    commit = "commit"
    release = "release"


class SearchStatus(enum.StrEnum):
    running = "running"  # fewer than K trials reported
    done = "done"  # K trials reported; the search's charge is committed
