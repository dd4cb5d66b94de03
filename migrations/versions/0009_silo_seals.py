"""silo seals: the seq of the entry in which an admin accepted a silo's record after a tamper

A silo whose stored promise (budget, δ, size, filter, plan) no longer recomputes to the hash of the
entry that covers it is refused every approval; an admin who inspected it may seal the record as it
stands, in a `seal` entry of the silo's chain (and of the transparency log). This column points at
the newest such entry, so that loading the silo checks one entry, never its history. Null: never
sealed (the create, filter and plan entries cover the record).

Revision ID: 0009
Revises: 0007
Create Date: 2026-11-27 10:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('silos', sa.Column('sealed_seq', sa.Integer(), nullable=True))


def downgrade() -> None:
    # Seal entries stay in the append-only log; without the column the code below this revision
    # would check the create entry again, so a sealed silo would be refused until restored.
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('sealed_seq')
