"""The one replay of a silo's chain (dpledger.wire.chain_replay), which the ledger's audit and an
auditor's recomposition both run: what it finds in a chain with a gap, a broken link, a settle
without a reserve, a second retirement and a reserve after it, and that it reads on past each."""

from __future__ import annotations

from dpledger.wire.chain_replay import GENESIS, ChainReplay, Link
from dpledger.wire.enums import ChargeStatus, EntryEvent


def _h(seq: int) -> str:
    return f"{seq:064x}"


def _chain(*events: tuple[str, int | None]) -> list[Link]:
    """Links of an honest chain: seq 1, 2, …, each linked to the hash of the one before."""
    return [Link(seq, GENESIS if seq == 1 else _h(seq - 1), _h(seq), event, charge)
            for seq, (event, charge) in enumerate(events, start=1)]


def test_an_honest_chain_finds_nothing_and_ends_where_its_last_entry_is() -> None:
    replay = ChainReplay()
    links = _chain(("create", None), ("reserve", 7), ("commit", 7), ("reserve", 8), ("release", 8), ("reserve", 9))
    steps = [replay.step(link) for link in links]
    assert all(s.follows and not s.misordered and s.retired_before is None for s in steps)
    assert [s.event for s in steps][:3] == [EntryEvent.create, EntryEvent.reserve, EntryEvent.commit]
    assert (replay.seq, replay.head) == (6, _h(6))
    assert replay.statuses == {7: ChargeStatus.committed, 8: ChargeStatus.released, 9: ChargeStatus.reserved}
    assert replay.reserves == [(2, 7), (4, 8), (6, 9)]
    assert steps[2].status_before is ChargeStatus.reserved


def test_a_gap_and_a_broken_link_are_each_named_and_the_chain_reads_on_from_them() -> None:
    replay = ChainReplay()
    replay.step(Link(1, GENESIS, _h(1), "create"))
    gap = replay.step(Link(3, _h(1), _h(3), "reserve", 5))  # entry 2 removed
    assert (gap.expected_seq, gap.unlinked, gap.follows) == (2, False, False)
    unlinked = replay.step(Link(4, _h(2), _h(4), "commit", 5))  # linked to what is no longer there
    assert (unlinked.expected_seq, unlinked.unlinked) == (None, True)
    after = replay.step(Link(5, _h(4), _h(5), "reserve", 6))
    assert after.follows


def test_a_settle_without_its_reserve_and_a_second_settle_are_misordered() -> None:
    replay = ChainReplay()
    steps = [replay.step(link) for link in _chain(("create", None), ("commit", 3), ("reserve", 4), ("commit", 4),
                                                   ("release", 4))]
    assert [s.misordered for s in steps] == [False, True, False, False, True]
    assert (steps[1].status_before, steps[4].status_before) == (None, ChargeStatus.committed)
    assert replay.statuses[4] is ChargeStatus.released  # the log's last word, as the ledger checks its rows against


def test_after_a_retire_entry_a_second_one_and_a_reserve_name_it() -> None:
    replay = ChainReplay()
    steps = [replay.step(link) for link in _chain(("create", None), ("retire", None), ("reserve", 1), ("retire", None))]
    assert [s.retired_before for s in steps] == [None, None, 2, 2]
    assert replay.retired_seq == 2


def test_an_unknown_event_and_a_charge_entry_naming_no_charge_move_nothing() -> None:
    replay = ChainReplay()
    steps = [replay.step(link) for link in _chain(("create", None), ("rewrite", 1), ("reserve", None))]
    assert steps[1].event is None and steps[1].follows
    assert steps[2].event is EntryEvent.reserve and not steps[2].misordered
    assert replay.statuses == {} and replay.reserves == []
