"""silo retirement: the entry in which an admin retired a mis-registered silo, and the reason

A silo registered wrongly (its dataset size, its budget) cannot be edited: its create entry and the
transparency log hold what it promised. An admin retires it instead, in a `retire` entry of its chain
(and of the log) whose hash covers the silo's identity and the reason; from then on the silo approves
nothing, while its reservations made before are still settled and everything stays readable. These
columns point at that entry and hold the reason, so that loading the silo checks one entry, never
its history. Null: in service.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 10:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('silos', sa.Column('retired_seq', sa.Integer(), nullable=True))
    op.add_column('silos', sa.Column('retired_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    # Code below this revision knows no retirement: it would approve on a retired silo again, and
    # read its retire entry as an unknown event. So a downgrade with any retired silo refuses.
    retired = op.get_bind().execute(sa.text("SELECT id FROM silos WHERE retired_seq IS NOT NULL ORDER BY id")).scalars().all()
    if retired:
        raise RuntimeError(f"silos {', '.join(map(str, retired))} are retired: code below revision 0012 would approve "
                           "on them again; a ledger with retired silos cannot be downgraded below 0012")
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('retired_reason')
        batch.drop_column('retired_seq')
