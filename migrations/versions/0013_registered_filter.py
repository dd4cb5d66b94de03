"""registered filter: the filter a silo registered with a horizon, kept once its first charge refits it

A silo's declared horizon fixes its filter at registration, and the create entry's hash covers it. A
first charge whose DP-SGD workload that filter reads far worse than a filter fitted to the charge
itself refits it (ledger/gate.py), in a filter entry, exactly as a silo without a horizon has its
filter fixed by its first charge. The create entry still covers what was registered: this column
keeps that text, so that the create entry's hash can be recomputed from the row. Null: never refit
(the create entry covers `filter_spec` itself, or none).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 12:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('silos', sa.Column('registered_filter', sa.Text(), nullable=True))


def downgrade() -> None:
    # Code below this revision would recompute a refit silo's create entry without the filter it
    # covered, and read its record as tampered: refused while any silo was refit.
    refit = op.get_bind().execute(sa.text("SELECT id FROM silos WHERE registered_filter IS NOT NULL ORDER BY id")).scalars().all()
    if refit:
        raise RuntimeError(f"silos {', '.join(map(str, refit))} had their registered filter refit by their first charge: "
                           "code below revision 0013 would read their create entries as tampered")
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('registered_filter')
