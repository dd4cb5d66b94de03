"""jobs norms and privacy levels

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 02:39:56.496079
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('privacy_levels',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('epsilon', sa.Float(), nullable=False),
    sa.Column('delta', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('job_silos',
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('silo_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.ForeignKeyConstraint(['silo_id'], ['silos.id'], ),
    sa.PrimaryKeyConstraint('job_id', 'silo_id')
    )
    op.create_table('norm_reports',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('round', sa.Integer(), nullable=False),
    sa.Column('silo_id', sa.Integer(), nullable=False),
    sa.Column('l2_norm', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.ForeignKeyConstraint(['silo_id'], ['silos.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'round', 'silo_id', name='uq_norm_reports_job_round_silo')
    )


def downgrade() -> None:
    op.drop_table('norm_reports')
    op.drop_table('job_silos')
    op.drop_table('privacy_levels')
    op.drop_table('jobs')
