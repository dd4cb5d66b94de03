"""curves stored once: a charge references its RDP curve, kept once per ledger under its SHA-256

Every charge stored its 156-order RDP curve as text (~3.3 KB), although a job repeats one (mechanism,
q, σ) pair over thousands of charges. The `curves` table keys each curve's exact text by its SHA-256;
a charge holds the key (`charges.curve_hash`). The text each charge's entries hash is the very text
moved here, byte for byte (tampered ones included: an edited curve stays as visible as it was), so
every entry, leaf and receipt recomputes as before.

Downgrade puts each charge's text back in `charges.rdp`: nothing is lost either way.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29 16:00:00.000000
"""
import hashlib

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

_PAGE = 5000  # charges read and keyed at a time: a ledger of millions is moved in bounded memory


def upgrade() -> None:
    op.create_table('curves',
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('rdp', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('hash')
    )
    with op.batch_alter_table('charges') as batch:
        batch.add_column(sa.Column('curve_hash', sa.String(length=64), nullable=True))
    bind = op.get_bind()
    charges = sa.table('charges', sa.column('id', sa.Integer()), sa.column('rdp', sa.Text()),
                       sa.column('curve_hash', sa.String(64)))
    curves = sa.table('curves', sa.column('hash', sa.String(64)), sa.column('rdp', sa.Text()))
    known: set[str] = set()
    after = 0
    while True:
        # Keyed here, not in SQL: SQLite has no SHA-256, and the key must be the one the service computes.
        rows = bind.execute(sa.select(charges.c.id, charges.c.rdp).where(charges.c.id > after)
                            .order_by(charges.c.id).limit(_PAGE)).all()
        if not rows:
            break
        keyed = [(row.id, hashlib.sha256(row.rdp.encode()).hexdigest(), row.rdp) for row in rows]
        new = {digest: text for _, digest, text in keyed if digest not in known}
        if new:
            bind.execute(sa.insert(curves), [{"hash": digest, "rdp": text} for digest, text in new.items()])
            known.update(new)
        bind.execute(sa.update(charges).where(charges.c.id == sa.bindparam("charge_id"))
                     .values(curve_hash=sa.bindparam("digest")),
                     [{"charge_id": charge_id, "digest": digest} for charge_id, digest, _ in keyed])
        after = rows[-1].id
    with op.batch_alter_table('charges') as batch:
        batch.alter_column('curve_hash', existing_type=sa.String(length=64), nullable=False)
        batch.create_foreign_key('fk_charges_curve_hash_curves', 'curves', ['curve_hash'], ['hash'])
        batch.drop_column('rdp')


def downgrade() -> None:
    with op.batch_alter_table('charges') as batch:
        batch.add_column(sa.Column('rdp', sa.Text(), nullable=True))
    op.execute("UPDATE charges SET rdp = (SELECT curves.rdp FROM curves WHERE curves.hash = charges.curve_hash)")
    with op.batch_alter_table('charges') as batch:
        batch.alter_column('rdp', existing_type=sa.Text(), nullable=False)
        batch.drop_constraint('fk_charges_curve_hash_curves', type_='foreignkey')
        batch.drop_column('curve_hash')
    op.drop_table('curves')
