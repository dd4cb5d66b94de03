"""A ledger's running RDP sum, kept so that release can subtract exactly what reserve added.

Some curves (repeat-and-select at low orders) are infinite at a few orders, and ∞ − ∞ is NaN; so
the sum is stored as its finite part plus, per order, the number of infinite terms in it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import orjson


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
        if np.isfinite(self.finite).all():
            # orjson writes each float's shortest text that parses back to it, as json does, in ~5 µs
            # against ~75 (an approval writes one sum). It would write an overflowed ∞ as null, which
            # parses as NaN, so a sum that is not all finite is written by json (as Infinity).
            text = orjson.dumps({"finite": self.finite, "infinite": self.infinite}, option=orjson.OPT_SERIALIZE_NUMPY).decode()
        else:
            text = json.dumps({"finite": self.finite.tolist(), "infinite": self.infinite.tolist()})
        _remember(text, RunningSum(self.finite.copy(), self.infinite.copy()))
        return text

    @classmethod
    def from_json(cls, text: str) -> RunningSum:
        found = _PARSED.get(text)
        if found is None:
            data = json.loads(text)
            found = cls(np.array(data["finite"], dtype=float), np.array(data["infinite"], dtype=np.int64))
            _remember(text, found)
        return found


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
