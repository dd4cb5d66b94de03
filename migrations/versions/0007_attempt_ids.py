"""attempt ids: the attempt that made a reservation, so that only its owner trains on it

A charge keeps the random attempt id its first reserve request carried and answers it on every
replay: a worker that retried its own lost request finds its id and trains; another delivery of the
same round finds a different one and does not. Charges made before this revision have none, so no
replay of them lets anyone train (fail closed).

Revision ID: 0007
Revises: 0005
Create Date: 2026-11-25 13:30:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('charges', sa.Column('attempt_id', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('charges') as batch:
        batch.drop_column('attempt_id')
