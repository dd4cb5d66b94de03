"""A ledger's running RDP sum, kept so that release can subtract exactly what reserve added.

Some curves (repeat-and-select at low orders) are infinite at a few orders, and ∞ − ∞ is NaN; so
the sum is stored as its finite part plus, per order, the number of infinite terms in it.
"""

from __future__ import annotations

import base64
import functools
import json
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RunningSum:
    finite: np.ndarray
    infinite: np.ndarray  # int counts per order

    @classmethod
    def empty(cls, n_orders: int) -> RunningSum:
        return cls(np.zeros(n_orders), np.zeros(n_orders, dtype=np.int64))

    def curve(self) -> np.ndarray:
        return np.where(self.infinite > 0, np.inf, self.finite)

    def add(self, curve: np.ndarray) -> RunningSum:
        inf = np.isinf(curve)
        added = np.where(inf, 0.0, curve)
        # Rounded up where something was added: fl(s + x) may sit half an ulp below s + x, and a sum
        # within rounding of a conversion's threshold must be read on its safe side.
        with np.errstate(over="ignore"):  # an overflowed sum stays ∞, as it would unrounded
            total = self.finite + added
            total = np.where(added != 0.0, np.nextafter(total, np.inf), total)
        return RunningSum(total, self.infinite + inf)

    def subtract(self, curve: np.ndarray) -> RunningSum:
        inf = np.isinf(curve)
        # fl(fl(s + x) − x) can land one ulp below s; adding one spacing of the sum we subtract from
        # bounds both roundings, so a release never leaves the ledger below its true spend.
        subtracted = np.where(inf, 0.0, curve)
        finite = self.finite - subtracted + np.where(subtracted != 0.0, np.spacing(self.finite), 0.0)
        return RunningSum(np.maximum(finite, 0.0), self.infinite - inf)

    def to_json(self) -> str:
        """The sum as the ledger stores it: "b64:" and the finite part's float64 bytes (little-endian)
        in base64, then ":" and the infinite counts' int64 bytes where any is nonzero. Exact (every
        float's bits, ∞ included) and 1,668 characters for 156 orders where JSON took ~3,400: a
        silo's row, rewritten at every approval, then fits twice in a PostgreSQL page, so that its
        old versions are pruned in place (HOT) rather than left for vacuum (bench/storage.py)."""
        text = _PREFIX + base64.b64encode(self.finite.astype("<f8").tobytes()).decode()
        if self.infinite.any():
            text += ":" + base64.b64encode(self.infinite.astype("<i8").tobytes()).decode()
        _remember(text, RunningSum(self.finite.copy(), self.infinite.copy()))
        return text

    @classmethod
    def from_json(cls, text: str) -> RunningSum:
        """Reads the stored form (to_json), and the JSON one ledgers before revision 0015 wrote
        ({"finite": [...], "infinite": [...]}); ValueError, TypeError or KeyError where neither parses."""
        found = _PARSED.get(text)
        if found is None:
            if text.startswith(_PREFIX):
                finite, _, infinite = text[len(_PREFIX):].partition(":")
                values = np.frombuffer(base64.b64decode(finite, validate=True), dtype="<f8").astype(float)
                counts = (np.frombuffer(base64.b64decode(infinite, validate=True), dtype="<i8").astype(np.int64)
                          if infinite else np.zeros(len(values), dtype=np.int64))
                if len(counts) != len(values):
                    raise ValueError("a running sum's finite part and infinite counts differ in length")
                found = cls(values, counts)
            else:
                data = json.loads(text)
                found = cls(np.array(data["finite"], dtype=float), np.array(data["infinite"], dtype=np.int64))
            _remember(text, found)
        return found


_PREFIX = "b64:"

# A silo's sum that an approval reads is, in a serving process, the text it wrote at the silo's
# previous approval: kept by text, the sum is parsed once, not at every approval (156 floats).
# Emptied at this size, like the curves' texts; read-only, since one sum may now serve many readers.
_PARSED_LIMIT = 1024
_PARSED: dict[str, RunningSum] = {}


def _remember(text: str, running: RunningSum) -> None:
    running.finite.flags.writeable = False
    running.infinite.flags.writeable = False
    if len(_PARSED) >= _PARSED_LIMIT:
        _PARSED.clear()
    _PARSED[text] = running


def curve_to_json(curve: np.ndarray) -> str:
    # Python's json writes Infinity; the column is text, so every database stores it verbatim.
    return _curve_json(np.ascontiguousarray(curve, dtype=float).tobytes())


@functools.lru_cache(maxsize=1024)
def _curve_json(raw: bytes) -> str:
    # Keyed by the floats' bytes, so the same curve (a job's repeated step, every round) is written
    # once per process: writing 156 floats is a visible share of an approval's CPU.
    return json.dumps(np.frombuffer(raw, dtype=float).tolist())


def curve_from_json(text: str) -> np.ndarray:
    return np.array(json.loads(text), dtype=float)
