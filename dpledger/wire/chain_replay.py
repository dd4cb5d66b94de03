"""A silo's hash chain read in order, one entry at a time: the rules every reader of a chain holds it to.

The ledger's own audit (`service/ledger/audit.py`, over its rows) and an auditor's recomposition of
the signed log (`dpledger/audit/recompose.py`, over the records the log serves) both replay a chain:
each entry must follow the one before it (its seq the next, its `prev_hash` that entry's hash); a
charge is reserved once, then settled at most once; a silo retires once, and reserves nothing after.
Those rules are written here once, so that the two readers cannot drift. Pure: no SQL, no I/O, no
accounting; each reader words the findings for its own report and adds what only it can check (the
stored rows behind an entry, the ε an entry states).

In the wire contract because both sides import it: the chain is what the ledger signs and serves,
and its rules are part of what a record means, like `merkle.py`'s proofs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpledger.wire.enums import ChargeStatus, EntryEvent

GENESIS = "0" * 64  # the `prev_hash` of a chain's first entry

# The event of each charge entry, and the status it leaves its charge in.
STATUS_AFTER = {
    EntryEvent.reserve: ChargeStatus.reserved,
    EntryEvent.commit: ChargeStatus.committed,
    EntryEvent.release: ChargeStatus.released,
}
# The status a charge must have in the chain before each event: reserved once, then settled at most
# once. A commit with no reserve before it means the reserve entry was removed.
STATUS_BEFORE: dict[EntryEvent, ChargeStatus | None] = {
    EntryEvent.reserve: None,
    EntryEvent.commit: ChargeStatus.reserved,
    EntryEvent.release: ChargeStatus.reserved,
}


@dataclass(frozen=True, slots=True)
class Link:
    """What the replay reads of an entry. `event` as stored or signed: one outside the vocabulary is a
    finding, not an error. `charge_id`: the charge a charge entry moves, or None where the reader
    found none it may move (a record entry, or an entry naming another silo's charge)."""

    seq: int
    prev_hash: str
    hash: str
    event: str
    charge_id: int | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """What one entry did to the chain, and what is wrong with it (each field None or False: nothing)."""

    event: EntryEvent | None  # None: an event outside the vocabulary
    expected_seq: int | None = None  # the seq the entry should have had, where it has another
    unlinked: bool = False  # its prev_hash is not the hash of the entry before it
    # A charge entry: the charge's status in the chain before it; `misordered` where that is not
    # the one its event needs (STATUS_BEFORE).
    status_before: ChargeStatus | None = None
    misordered: bool = False
    retired_before: int | None = None  # a retire or reserve entry: the seq of the silo's retire entry before it

    @property
    def follows(self) -> bool:
        """Whether the entry is the next of its chain, by seq and by hash."""
        return self.expected_seq is None and not self.unlinked


@dataclass
class ChainReplay:
    """One silo's chain, fed its entries in order (`step`); what it holds is the chain so far."""

    seq: int = 0  # the last entry's seq (0: none yet)
    head: str = GENESIS  # the last entry's hash
    statuses: dict[int, ChargeStatus] = field(default_factory=dict)  # each charge's status, as its entries leave it
    reserves: list[tuple[int, int]] = field(default_factory=list)  # (seq, charge id) of each reserve entry, in order
    retired_seq: int | None = None  # the seq of the silo's first retire entry

    def step(self, link: Link) -> Step:
        """Reads the next entry. The chain moves on from it whatever is wrong with it, so that one bad
        entry is named once and the entries after it are read against it, as they were written."""
        expected = self.seq + 1
        unlinked = link.prev_hash != self.head
        self.seq, self.head = link.seq, link.hash
        try:
            event: EntryEvent | None = EntryEvent(link.event)
        except ValueError:
            event = None
        status_before, misordered = None, False
        if event in STATUS_AFTER and link.charge_id is not None:
            assert event is not None  # narrowed by the membership above
            status_before = self.statuses.get(link.charge_id)
            misordered = status_before != STATUS_BEFORE[event]
            self.statuses[link.charge_id] = STATUS_AFTER[event]
            if event is EntryEvent.reserve:
                self.reserves.append((link.seq, link.charge_id))
        retired_before = self.retired_seq if event in (EntryEvent.retire, EntryEvent.reserve) else None
        if event is EntryEvent.retire and self.retired_seq is None:
            self.retired_seq = link.seq
        return Step(event, expected_seq=None if link.seq == expected else expected, unlinked=unlinked,
                    status_before=status_before, misordered=misordered, retired_before=retired_before)

