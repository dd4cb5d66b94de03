"""filters and plans: each silo's Rényi filter (orders, δ shares) and an optional declared plan

Silos registered before this revision get a filter now, recorded in a new `filter` entry at the end
of their chain (their create entries stay as they were hashed): a silo that holds charges gets the
union bound over every order the old rule could approve at, with δ split evenly (the orders it was
gated on); one with no charge yet gets the filter it would get if registered now. Downgrade drops the
columns where no filter or plan entry exists yet (the transparency log is append-only); chains of
silos registered under this revision would no longer verify under the old code, since their create
entries cover the filter.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 08:00:00.000000
"""
from datetime import UTC, datetime
from types import SimpleNamespace

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

_silos = sa.table(
    'silos', sa.column('id', sa.Integer), sa.column('epsilon', sa.Float), sa.column('delta', sa.Float),
    sa.column('dataset_size', sa.BigInteger), sa.column('rdp_spent', sa.Text), sa.column('chain_seq', sa.Integer),
    sa.column('chain_head', sa.String), sa.column('filter_spec', sa.Text), sa.column('filter_seq', sa.Integer),
)
_entries = sa.table(
    'ledger_entries', sa.column('id', sa.Integer), sa.column('silo_id', sa.Integer), sa.column('seq', sa.Integer),
    sa.column('event', sa.String),
    sa.column('charge_id', sa.Integer), sa.column('epsilon_spent', sa.Float), sa.column('created_at', sa.DateTime(timezone=True)),
    sa.column('prev_hash', sa.String), sa.column('hash', sa.String),
)
_charges = sa.table('charges', sa.column('id', sa.Integer), sa.column('silo_id', sa.Integer))


def upgrade() -> None:
    # Imported here: the revision file is loaded by Alembic for every command, the math only on upgrade.
    from sqlalchemy.orm import Session

    from dpledger.service.accounting import filter as rdp_filter
    from dpledger.service.accounting.running_sum import RunningSum
    from dpledger.service.ledger import chain, transparency

    with op.batch_alter_table('silos') as batch:
        batch.add_column(sa.Column('filter_spec', sa.Text(), nullable=True))
        batch.add_column(sa.Column('filter_seq', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('plan', sa.Text(), nullable=True))
        batch.add_column(sa.Column('plan_used', sa.Integer(), nullable=False, server_default='0'))

    connection = op.get_bind()
    session = Session(bind=connection)  # transparency.append runs its statements through a session
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
        subject = {"silo_id": silo.id, "filter": spec_json}
        digest = chain.entry_hash(entry, subject=subject)  # type: ignore[arg-type]  # a namespace, not the ORM row
        inserted = _entries.insert().values(hash=digest, **vars(entry)).returning(_entries.c.id)
        entry.id = connection.execute(inserted).scalar_one()
        entry.hash = digest
        transparency.append(session, entry, subject=subject)  # type: ignore[arg-type]  # the log's next leaf
        connection.execute(
            _silos.update().where(_silos.c.id == silo.id)
            .values(filter_spec=spec_json, filter_seq=entry.seq, chain_seq=entry.seq, chain_head=digest)
        )

    with op.batch_alter_table('silos') as batch:
        batch.alter_column('filter_spec', existing_type=sa.Text(), nullable=False)
        batch.alter_column('filter_seq', existing_type=sa.Integer(), nullable=False)


def downgrade() -> None:
    # The transparency log is append-only: filter and plan entries in it cannot be taken out, so a
    # ledger that has any refuses to go back (a fresh one, or one with none, downgrades cleanly).
    connection = op.get_bind()
    count = connection.execute(
        sa.select(sa.func.count()).select_from(_entries).where(_entries.c.event.in_(['filter', 'plan']))
    ).scalar_one()
    if count:
        raise RuntimeError(f"{count} filter/plan entries are in the append-only transparency log: not downgrading 0005")
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('plan_used')
        batch.drop_column('plan')
        batch.drop_column('filter_seq')
        batch.drop_column('filter_spec')
