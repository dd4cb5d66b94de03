"""transparency log: leaves, completed subtrees, the log's state, heads auditors verified; entries backfilled

Revision ID: 0006
Revises: 0003
Create Date: 2026-11-24 08:00:00.000000
"""
import json
from typing import Any, cast

import sqlalchemy as sa
from alembic import op

from dpledger.service.ledger import chain, transparency
from dpledger.wire import merkle

revision = '0006'
down_revision = "0003"
branch_labels = None
depends_on = None

_ENTRY = "SELECT id, silo_id, seq, event, charge_id, epsilon_spent, created_at, prev_hash, hash FROM ledger_entries ORDER BY id"
_SILO = "SELECT id, name, epsilon, delta, dataset_size, created_at FROM silos"
_CHARGE = ("SELECT id, silo_id, idempotency_key, request_hash, mechanism, rdp, order_grid, conversion, job_id, round, "
           "epsilon_spent_after, created_at FROM charges")


def _typed(query: str) -> sa.TextualSelect:
    # Typed, so that SQLite's stored text comes back as the datetime the ORM would have read.
    return sa.text(query).columns(created_at=sa.DateTime(timezone=True))


def upgrade() -> None:
    leaves = op.create_table('log_leaves',
    sa.Column('idx', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('entry_id', sa.Integer(), nullable=False),
    sa.Column('salt', sa.String(length=32), nullable=False),
    sa.Column('leaf_hash', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('idx'),
    sa.UniqueConstraint('entry_id')
    )
    nodes = op.create_table('log_nodes',
    sa.Column('level', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('idx', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('level', 'idx')
    )
    state = op.create_table('log_state',
    sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('frontier', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('verified_heads',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tree_size', sa.BigInteger(), nullable=False),
    sa.Column('root_hash', sa.String(length=64), nullable=False),
    sa.Column('signed_at', sa.BigInteger(), nullable=False),
    sa.Column('key_id', sa.String(length=64), nullable=False),
    sa.Column('signature', sa.String(length=200), nullable=False),
    sa.Column('api_key_id', sa.Integer(), nullable=False),
    sa.Column('verified_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    # A ledger that already has entries gets them as leaves in entry-id order (their append order),
    # read with plain SQL so that later changes to the ORM models cannot break this revision.
    bind = op.get_bind()
    # The rows carry every attribute the chain's field functions read (they take the ORM classes).
    silos = {row.id: chain.silo_fields(cast(Any, row)) for row in bind.execute(_typed(_SILO))}
    charges = {row.id: chain.charge_fields(cast(Any, row)) for row in bind.execute(_typed(_CHARGE))}
    frontier: list[bytes] = []
    leaf_rows, node_rows = [], []
    for index, entry in enumerate(bind.execute(_typed(_ENTRY))):
        subject = silos[entry.silo_id] if entry.charge_id is None else charges[entry.charge_id]
        salt = transparency.new_salt()
        leaf = merkle.leaf_hash(transparency.leaf_record(entry, subject=subject, salt=salt).encode())
        frontier, completed, _ = merkle.append(frontier, index, leaf)
        leaf_rows.append({"idx": index, "entry_id": entry.id, "salt": salt, "leaf_hash": leaf.hex()})
        node_rows += [{"level": w.bit_length() - 1, "idx": s // w, "hash": h.hex()} for s, w, h in completed]
    if leaf_rows:
        op.bulk_insert(leaves, leaf_rows)
    if node_rows:
        op.bulk_insert(nodes, node_rows)
    op.bulk_insert(state, [{"id": transparency.STATE_ID, "size": len(leaf_rows),
                            "frontier": json.dumps([h.hex() for h in frontier])}])


def downgrade() -> None:
    op.drop_table('verified_heads')
    op.drop_table('log_state')
    op.drop_table('log_nodes')
    op.drop_table('log_leaves')
