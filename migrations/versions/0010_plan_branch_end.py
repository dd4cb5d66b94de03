"""plan branch end: the seq of the reserve entry whose charge left the silo's declared plan

A silo may declare a plan and still take adaptive charges: its δ is split between the plan's branch
and its Rényi filter, and the gate reads the lower of the two while every charge follows the plan.
The first charge off the plan ends the plan's branch (never the silo): this column points at that
charge's reserve entry, so that loading the silo knows which reading holds without its history.
Null: the branch is alive (or the silo declared no plan).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 10:00:00.000000
"""
import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('silos', sa.Column('plan_ended_seq', sa.Integer(), nullable=True))


def downgrade() -> None:
    # Code below this revision gates a silo on a plan by the plan alone: a silo whose branch ended
    # must not be served by it (its charges off the plan would read as the plan's ε).
    with op.batch_alter_table('silos') as batch:
        batch.drop_column('plan_ended_seq')
