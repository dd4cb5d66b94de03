"""Curves stored once per ledger (service/store/curves.py): keyed by their text's SHA-256, written once,
and known to the process (so not written again) only once the transaction that wrote them committed."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import func, select

from dpledger.service.store import curves
from dpledger.service.store.db import Database
from dpledger.service.store.models import Curve

TEXT = "[0.25,0.5,Infinity]"


def stored(db: Database) -> int:
    with db.read() as session:
        return int(session.scalar(select(func.count()).select_from(Curve)) or 0)


def test_a_curve_is_keyed_by_the_sha256_of_its_exact_text() -> None:
    assert curves.key(TEXT) == hashlib.sha256(TEXT.encode()).hexdigest()
    assert curves.key(TEXT + " ") != curves.key(TEXT)  # the very bytes the entries hash, not a parse of them
    assert not curves.mismatched(curves.key(TEXT), TEXT)
    assert curves.mismatched(curves.key(TEXT), TEXT.replace("0.25", "0.125")) and curves.mismatched(curves.key(TEXT), None)


def test_a_curve_is_known_only_once_the_transaction_that_wrote_it_committed(database_url: str) -> None:
    db = Database.connect(database_url)
    try:
        with pytest.raises(RuntimeError), db.write() as session:
            assert curves.store(session, TEXT) == curves.key(TEXT)
            raise RuntimeError("rolled back")
        assert curves.key(TEXT) not in db.curves and stored(db) == 0  # a later charge writes it again
        with db.write() as session:
            curves.store(session, TEXT)
            assert curves.key(TEXT) not in db.curves  # not before its commit
        assert curves.key(TEXT) in db.curves and stored(db) == 1
        with db.write() as session:
            assert curves.reference(session, TEXT) == (curves.key(TEXT), False)  # known: nothing to write
        # Another process (its own set) writes the same curve: the row is there already, and stays one.
        other = Database(db.engine)
        with other.write() as session:
            assert curves.reference(session, TEXT)[1] is True
            curves.store(session, TEXT)
        assert stored(db) == 1
    finally:
        db.dispose()


def test_the_set_starts_over_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(curves, "KNOWN_AT_MOST", 2)
    known = curves.Known()
    known.add(["a", "b"])
    known.add(["c"])
    assert "c" in known and "a" not in known  # it only ever saves a write: forgetting costs one
