"""Inline SVG charts from numbers: a budget bar and an ε-over-time line chart.

Only presentation attributes (fill, stroke), never `style=`: the pages' Content-Security-Policy
admits the one stylesheet by its hash, and inline style attributes would need 'unsafe-inline'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from dpledger.wire.numbers import budget_state, exact, shown

SPENT_COLOUR = "#c0392b"
# The bar's colour by how much of the budget is spent (numbers.budget_state): a bar at 59% looked
# as alarming as an exhausted one when every bar was red.
STATE_COLOURS = {"fine": "#1e8449", "near": "#d68910", "exhausted": "#c0392b"}
COMMITTED_COLOUR = "#1f618d"
BUDGET_COLOUR = "#7f8c8d"
TRACK_COLOUR = "#e5e8e8"
REFERENCE_COLOUR = "#8e8e8e"


def bar(*, spent: float, budget: float, width: int = 160, height: int = 14) -> str:
    """The spent share of a budget. An unbounded ε (∞) fills the bar: it is over any budget."""
    share = 1.0 if not math.isfinite(spent) else min(max(spent / budget, 0.0), 1.0)
    fill_width = round(share * width, 2)
    state = budget_state(spent=spent, budget=budget)
    label = f"{shown(100 * share)}% of the budget spent" if math.isfinite(spent) else "unbounded ε: the whole budget"
    label += " (exhausted)" if state == "exhausted" and math.isfinite(spent) else ""
    return (
        f'<svg class="bar" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"'
        f' data-share="{exact(share)}" data-state="{state}" aria-label="{escape(label)}">'
        f"<title>{escape(label)}</title>"
        f'<rect width="{width}" height="{height}" fill="{TRACK_COLOUR}"/>'
        f'<rect class="bar-spent" width="{fill_width}" height="{height}" fill="{STATE_COLOURS[state]}"/>'
        "</svg>"
    )


@dataclass(frozen=True)
class Point:
    seq: int
    committed: float  # ε of committed charges only, after this entry (the gate's reading)
    spent: float  # ε of committed + reserved charges, after this entry (the gate's reading)
    reference: float = math.nan  # dp-accounting's non-adaptive ε of committed + reserved charges; nan: unknown


@dataclass(frozen=True)
class _Frame:
    width: int = 640
    height: int = 280
    left: int = 56
    right: int = 16
    top: int = 34  # room for the legend, above the plot so that no line runs under it
    bottom: int = 36

    def x(self, seq: int, first: int, last: int) -> float:
        span = max(last - first, 1)
        return round(self.left + (seq - first) / span * (self.width - self.left - self.right), 2)

    def y(self, value: float, top_value: float) -> float:
        # ∞ sits on the top edge: drawn as "off the chart", never silently dropped.
        clipped = top_value if not math.isfinite(value) else min(value, top_value)
        return round(self.height - self.bottom - clipped / top_value * (self.height - self.top - self.bottom), 2)


def line_chart(points: Sequence[Point], *, budget: float) -> str:
    """ε after each ledger entry: committed, and committed + reserved, against the budget line (the
    gate's readings), with dp-accounting's non-adaptive ε of committed + reserved dashed, for reference."""
    frame = _Frame()
    finite = [v for p in points for v in (p.committed, p.spent, p.reference) if math.isfinite(v)]
    top_value = max([budget, *finite]) * 1.05
    first, last = (points[0].seq, points[-1].seq) if points else (0, 1)
    parts = [
        f'<svg class="line-chart" width="{frame.width}" height="{frame.height}"'
        f' viewBox="0 0 {frame.width} {frame.height}" role="img" data-points="{len(points)}"'
        ' aria-label="ε after each ledger entry">',
        "<title>ε after each ledger entry</title>",
        _axes(frame, top_value, first, last),
    ]
    budget_y = frame.y(budget, top_value)
    parts.append(
        f'<line class="budget" x1="{frame.left}" x2="{frame.width - frame.right}" y1="{budget_y}" y2="{budget_y}"'
        f' stroke="{BUDGET_COLOUR}" stroke-dasharray="6 4"/>'
        f'<text x="{frame.width - frame.right}" y="{budget_y - 4}" text-anchor="end" font-size="11"'
        f' fill="{BUDGET_COLOUR}">budget ε = {escape(shown(budget))}</text>'
    )
    for name, colour, values, dash in (
        ("reference", REFERENCE_COLOUR, [p.reference for p in points], ' stroke-dasharray="3 3"'),
        ("spent", SPENT_COLOUR, [p.spent for p in points], ""),
        ("committed", COMMITTED_COLOUR, [p.committed for p in points], ""),
    ):
        drawn = [(p, v) for p, v in zip(points, values, strict=True) if not math.isnan(v)]
        coordinates = [(frame.x(p.seq, first, last), frame.y(v, top_value)) for p, v in drawn]
        path = " ".join(f"{x},{y}" for x, y in coordinates)
        parts.append(f'<polyline class="series-{name}" points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for (p, v), (x, y) in zip(drawn, coordinates, strict=True):
            parts.append(
                f'<circle class="point-{name}" cx="{x}" cy="{y}" r="3" fill="{colour}"'
                f' data-seq="{p.seq}" data-epsilon="{exact(v)}">'
                f"<title>entry {p.seq}: {name} ε = {escape(shown(v))}</title></circle>"
            )
    parts.append(_legend(frame))
    parts.append("</svg>")
    return "".join(parts)


def _axes(frame: _Frame, top_value: float, first: int, last: int) -> str:
    bottom_y = frame.height - frame.bottom
    parts = [
        f'<line x1="{frame.left}" x2="{frame.left}" y1="{frame.top}" y2="{bottom_y}" stroke="#333"/>',
        f'<line x1="{frame.left}" x2="{frame.width - frame.right}" y1="{bottom_y}" y2="{bottom_y}" stroke="#333"/>',
    ]
    for i in range(5):
        value = top_value * i / 4
        y = frame.y(value, top_value)
        parts.append(
            f'<line x1="{frame.left - 4}" x2="{frame.left}" y1="{y}" y2="{y}" stroke="#333"/>'
            f'<text x="{frame.left - 6}" y="{y + 4}" text-anchor="end" font-size="11">{escape(shown(value))}</text>'
        )
    for seq in sorted({first, last}):
        x = frame.x(seq, first, last)
        parts.append(f'<text x="{x}" y="{bottom_y + 14}" text-anchor="middle" font-size="11">{seq}</text>')
    parts.append(
        f'<text x="{(frame.left + frame.width - frame.right) / 2}" y="{frame.height - 6}" text-anchor="middle"'
        ' font-size="11">ledger entry (seq)</text>'
    )
    return "".join(parts)


def _legend(frame: _Frame) -> str:
    x = frame.left
    return (
        f'<rect x="{x}" y="8" width="10" height="10" fill="{SPENT_COLOUR}"/>'
        f'<text x="{x + 14}" y="17" font-size="11">committed + reserved ε</text>'
        f'<rect x="{x + 170}" y="8" width="10" height="10" fill="{COMMITTED_COLOUR}"/>'
        f'<text x="{x + 184}" y="17" font-size="11">committed ε</text>'
        f'<rect x="{x + 270}" y="8" width="10" height="10" fill="{REFERENCE_COLOUR}"/>'
        f'<text x="{x + 284}" y="17" font-size="11">dp-accounting ε (reference)</text>'
    )
