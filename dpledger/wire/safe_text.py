"""Text chosen by a silo (job ids, names), neutralised before an auditor's terminal or spreadsheet
shows it. Standard library only. In the wire contract because both sides neutralise the same way: the
service's CSV export (`safe_cell`) and the people's commands (`visible`)."""

from __future__ import annotations

import unicodedata

# A cell starting with one of these is run as a formula by spreadsheet programs (OWASP, "CSV
# injection"); a leading apostrophe makes it text and shows what was stored.
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def visible(text: str) -> str:
    """Control characters (ESC of a terminal escape sequence, CR, NUL, bidi overrides…) as `\\xNN` /
    `\\uNNNN`, so a terminal shows them instead of obeying them."""
    out = []
    for char in text:
        category = unicodedata.category(char)
        if category in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return "".join(out)


def safe_cell(text: str) -> str:
    """A CSV cell that spreadsheets show as text: control characters made visible, a formula
    prefix escaped with an apostrophe."""
    if text.startswith(FORMULA_PREFIXES):
        text = "'" + text
    return visible(text)
