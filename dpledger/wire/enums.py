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
    filter = "filter"  # the silo's filter orders and δ shares, for silos that held charges before filters
    plan = "plan"  # a plan declared before the silo's first charge
    seal = "seal"  # an admin accepted the silo's record as it stands after a tamper (the record it covers)
    retire = "retire"  # an admin retired a mis-registered silo: it approves nothing after (the reason it covers)


class SearchStatus(enum.StrEnum):
    running = "running"  # fewer than K trials reported
    done = "done"  # K trials reported; the search's charge is committed


class Relation(enum.StrEnum):
    """A silo's neighbouring relation: what "one person's data" changes between neighbouring
    datasets. Add/remove-one hides whether a record is there at all (the default; Poisson sampling
    and DP-SGD are analysed under it); replace-one hides only which record it is, so the dataset's
    size is public (sampling without replacement is analysed under it)."""

    add_remove = "add_remove"
    replace_one = "replace_one"
