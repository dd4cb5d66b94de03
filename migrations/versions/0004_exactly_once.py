"""exactly once: a silo's neighbouring relation, and when a charge's round first reported an output

Revision ID: 0004
Revises: 0006
Create Date: 2026-11-24 08:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every silo registered so far was accounted under add/remove-one (the only relation there was).
    op.add_column('silos', sa.Column('relation', sa.String(length=16), nullable=False, server_default='add_remove'))
    op.add_column('charges', sa.Column('touched_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('charges') as batch:
        batch.drop_column('touched_at')
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('relation')
