"""log sequencer: pending leaves written by approvals, the heads signed per batch, each leaf's promise

Approvals no longer append to the transparency log under its one state row: each writes its leaf
to `log_pending` in its own transaction, and a sequencer gives pending leaves their log indices in
batches, signing one head per batch (`log_heads`). `log_leaves.promised_by` keeps the deadline the
receipt promised (null for leaves sequenced before this revision, whose receipts carried a head).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 10:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('log_pending',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('entry_id', sa.Integer(), nullable=False),
    sa.Column('salt', sa.String(length=32), nullable=False),
    sa.Column('leaf_hash', sa.String(length=64), nullable=False),
    sa.Column('promised_by', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('entry_id')
    )
    op.create_table('log_heads',
    sa.Column('tree_size', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('root_hash', sa.String(length=64), nullable=False),
    sa.Column('timestamp', sa.BigInteger(), nullable=False),
    sa.Column('key_id', sa.String(length=64), nullable=False),
    sa.Column('signature', sa.String(length=200), nullable=False),
    sa.PrimaryKeyConstraint('tree_size')
    )
    op.add_column('log_leaves', sa.Column('promised_by', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Code below this revision appends every entry to the log in its own transaction: leaves still
    # pending here would be entries missing from its log, so a downgrade with any refuses.
    pending = op.get_bind().execute(sa.text("SELECT count(*) FROM log_pending")).scalar_one()
    if pending:
        raise RuntimeError(f"{pending} ledger entries are not sequenced yet: run the server until the log holds them")
    with op.batch_alter_table('log_leaves') as batch:
        batch.drop_column('promised_by')
    op.drop_table('log_heads')
    op.drop_table('log_pending')
