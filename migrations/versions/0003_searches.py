"""searches

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 10:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('searches',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('silo_id', sa.Integer(), nullable=False),
    sa.Column('charge_id', sa.Integer(), nullable=False),
    sa.Column('trial_mechanism', sa.Text(), nullable=False),
    sa.Column('distribution', sa.String(length=40), nullable=False),
    sa.Column('shape', sa.String(length=40), nullable=False),
    sa.Column('mean_trials', sa.Float(), nullable=False),
    sa.Column('trials', sa.Integer(), nullable=False),
    sa.Column('trials_reported', sa.Integer(), nullable=False),
    sa.Column('best_score', sa.Float(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['charge_id'], ['charges.id'], ),
    sa.ForeignKeyConstraint(['silo_id'], ['silos.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('charge_id')
    )
    op.create_index(op.f('ix_searches_silo_id'), 'searches', ['silo_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_searches_silo_id'), table_name='searches')
    op.drop_table('searches')
