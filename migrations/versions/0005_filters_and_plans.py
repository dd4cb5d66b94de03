"""filters and plans: each silo's Rényi filter (orders, δ shares) and an optional declared plan

Silos registered before this revision get a filter now, recorded in a new `filter` entry at the end
of their chain (their create entries stay as they were hashed): a silo that holds charges gets the
union bound over every order the old rule could approve at, with δ split evenly (the orders it was
gated on); one with no charge yet gets the filter it would get if registered now. Downgrade drops the
columns and the filter and plan entries; chains of silos registered under this revision then no
longer verify under the old code, since their create entries cover the filter.

Revision ID: 0005
Revises: 0003
Create Date: 2026-11-24 08:00:00.000000
"""
from datetime import UTC, datetime
from types import SimpleNamespace

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0003'
branch_labels = None
depends_on = None

_silos = sa.table(
    'silos', sa.column('id', sa.Integer), sa.column('epsilon', sa.Float), sa.column('delta', sa.Float),
    sa.column('dataset_size', sa.BigInteger), sa.column('rdp_spent', sa.Text), sa.column('chain_seq', sa.Integer),
    sa.column('chain_head', sa.String), sa.column('filter_spec', sa.Text), sa.column('filter_seq', sa.Integer),
)
_entries = sa.table(
    'ledger_entries', sa.column('silo_id', sa.Integer), sa.column('seq', sa.Integer), sa.column('event', sa.String),
    sa.column('charge_id', sa.Integer), sa.column('epsilon_spent', sa.Float), sa.column('created_at', sa.DateTime(timezone=True)),
    sa.column('prev_hash', sa.String), sa.column('hash', sa.String),
)
_charges = sa.table('charges', sa.column('id', sa.Integer), sa.column('silo_id', sa.Integer))


def upgrade() -> None:
    # Imported here: the revision file is loaded by Alembic for every command, the math only on upgrade.
    from dpledger.service.accounting import filter as rdp_filter
    from dpledger.service.accounting.running_sum import RunningSum
    from dpledger.service.ledger import chain

    with op.batch_alter_table('silos') as batch:
        batch.add_column(sa.Column('filter_spec', sa.Text(), nullable=True))
        batch.add_column(sa.Column('filter_seq', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('plan', sa.Text(), nullable=True))
        batch.add_column(sa.Column('plan_used', sa.Integer(), nullable=False, server_default='0'))

    connection = op.get_bind()
    now = datetime.now(UTC)
    for silo in connection.execute(sa.select(_silos).order_by(_silos.c.id)).all():
        holds_charges = connection.execute(sa.select(_charges.c.id).where(_charges.c.silo_id == silo.id).limit(1)).first()
        if holds_charges is not None:
            spec = rdp_filter.legacy_spec()
        else:
            spec = rdp_filter.default_spec(epsilon=silo.epsilon, delta=silo.delta, dataset_size=silo.dataset_size)
        spec_json = spec.to_json()
        spent = rdp_filter.read(spec, RunningSum.from_json(silo.rdp_spent).curve(), delta=silo.delta).epsilon
        entry = SimpleNamespace(
            silo_id=silo.id, seq=silo.chain_seq + 1, event='filter', charge_id=None, epsilon_spent=spent,
            created_at=now, prev_hash=silo.chain_head,
        )
        # chain.filter_fields' subject; entry_hash reads only these attributes, so a namespace stands in
        # for the ORM row (the migration writes through SQL, not the models).
        digest = chain.entry_hash(entry, subject={"silo_id": silo.id, "filter": spec_json})  # type: ignore[arg-type]
        connection.execute(_entries.insert().values(hash=digest, **vars(entry)))
        connection.execute(
            _silos.update().where(_silos.c.id == silo.id)
            .values(filter_spec=spec_json, filter_seq=entry.seq, chain_seq=entry.seq, chain_head=digest)
        )

    with op.batch_alter_table('silos') as batch:
        batch.alter_column('filter_spec', existing_type=sa.Text(), nullable=False)
        batch.alter_column('filter_seq', existing_type=sa.Integer(), nullable=False)


def downgrade() -> None:
    # Back to the old chain: filter and plan entries go, and each head returns to its last other entry.
    connection = op.get_bind()
    connection.execute(_entries.delete().where(_entries.c.event.in_(['filter', 'plan'])))
    for (silo_id,) in connection.execute(sa.select(_silos.c.id)).all():
        last = connection.execute(
            sa.select(_entries.c.seq, _entries.c.hash).where(_entries.c.silo_id == silo_id)
            .order_by(_entries.c.seq.desc()).limit(1)
        ).first()
        if last is not None:
            connection.execute(_silos.update().where(_silos.c.id == silo_id).values(chain_seq=last.seq, chain_head=last.hash))
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('plan_used')
        batch.drop_column('plan')
        batch.drop_column('filter_seq')
        batch.drop_column('filter_spec')
