"""running sums in base64: a silo's two running RDP sums stored as their float64 bytes

A silo's row is rewritten at every approval, and its two running sums were JSON text (~3.4 KB each
for 156 orders). On PostgreSQL that pushed the sums out of line into TOAST, where every approval left
a dead copy for vacuum: ~11 KB a charge. Stored as "b64:" and the base64 of their little-endian
float64 bytes (then ":" and the int64 infinite counts where any is nonzero: service/accounting/
running_sum.py), the same values take 1,668 characters each; `STORAGE MAIN` keeps them in the row
(~3.5 KB), and `fillfactor = 50` has PostgreSQL prune a page once half of it is used, so that the
row's next version always finds room beside the live one: every update is a HOT update whose old
version is pruned in place, and the table stops growing with approvals.

Every row is rewritten to the new form, value for value (exact: the floats' bits). A text that does
not parse as a sum (an edited row) is left as it is, as visible to the audit as before. Downgrade
writes JSON back.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29 19:00:00.000000
"""
import base64
import json
from collections.abc import Callable

import numpy as np
import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

_PREFIX = "b64:"
_COLUMNS = ("rdp_spent", "rdp_committed")


def _to_base64(text: str) -> str:
    try:
        data = json.loads(text)
        finite = np.array(data["finite"], dtype="<f8")
        infinite = np.array(data["infinite"], dtype="<i8")
    except (ValueError, TypeError, KeyError):
        return text  # not a sum: left for the audit to name
    out = _PREFIX + base64.b64encode(finite.tobytes()).decode()
    return out + (":" + base64.b64encode(infinite.tobytes()).decode() if infinite.any() else "")


def _to_json(text: str) -> str:
    if not text.startswith(_PREFIX):
        return text
    finite, _, infinite = text[len(_PREFIX):].partition(":")
    values = np.frombuffer(base64.b64decode(finite), dtype="<f8")
    counts = np.frombuffer(base64.b64decode(infinite), dtype="<i8") if infinite else np.zeros(len(values), dtype=int)
    return json.dumps({"finite": values.tolist(), "infinite": [int(c) for c in counts]})


def _rewrite(convert: Callable[[str], str]) -> None:
    bind = op.get_bind()
    silos = sa.table('silos', sa.column('id', sa.Integer()), *(sa.column(c, sa.Text()) for c in _COLUMNS))
    rows = bind.execute(sa.select(silos.c.id, *(silos.c[c] for c in _COLUMNS))).all()
    for row in rows:
        bind.execute(sa.update(silos).where(silos.c.id == row.id)
                     .values({c: convert(getattr(row, c)) for c in _COLUMNS}))


def upgrade() -> None:
    _rewrite(_to_base64)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE silos ALTER COLUMN rdp_spent SET STORAGE MAIN, "
                   "ALTER COLUMN rdp_committed SET STORAGE MAIN, SET (fillfactor = 50)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE silos ALTER COLUMN rdp_spent SET STORAGE EXTENDED, "
                   "ALTER COLUMN rdp_committed SET STORAGE EXTENDED, RESET (fillfactor)")
    _rewrite(_to_json)
