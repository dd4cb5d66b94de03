"""ledger tables

Revision ID: 0001
Revises:
Create Date: 2026-11-22 01:54:16.581695
"""
import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('silos',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('epsilon', sa.Float(), nullable=False),
    sa.Column('delta', sa.Float(), nullable=False),
    sa.Column('dataset_size', sa.BigInteger(), nullable=False),
    sa.Column('rdp_spent', sa.Text(), nullable=False),
    sa.Column('rdp_committed', sa.Text(), nullable=False),
    sa.Column('chain_seq', sa.Integer(), nullable=False),
    sa.Column('chain_head', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('api_keys',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('silo_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['silo_id'], ['silos.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    op.create_table('charges',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('silo_id', sa.Integer(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=200), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('mechanism', sa.Text(), nullable=False),
    sa.Column('rdp', sa.Text(), nullable=False),
    sa.Column('order_grid', sa.String(length=100), nullable=False),
    sa.Column('conversion', sa.String(length=100), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('job_id', sa.String(length=200), nullable=True),
    sa.Column('round', sa.Integer(), nullable=True),
    sa.Column('epsilon_spent_after', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['silo_id'], ['silos.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('silo_id', 'idempotency_key', name='uq_charges_silo_idempotency')
    )
    with op.batch_alter_table('charges', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_charges_silo_id'), ['silo_id'], unique=False)

    op.create_table('ledger_entries',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('silo_id', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('event', sa.String(length=16), nullable=False),
    sa.Column('charge_id', sa.Integer(), nullable=True),
    sa.Column('epsilon_spent', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('prev_hash', sa.String(length=64), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.ForeignKeyConstraint(['charge_id'], ['charges.id'], ),
    sa.ForeignKeyConstraint(['silo_id'], ['silos.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('silo_id', 'seq', name='uq_ledger_entries_silo_seq')
    )
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.create_index('ix_ledger_entries_charge', ['charge_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_ledger_entries_charge')

    op.drop_table('ledger_entries')
    with op.batch_alter_table('charges', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_charges_silo_id'))

    op.drop_table('charges')
    op.drop_table('api_keys')
    op.drop_table('silos')
