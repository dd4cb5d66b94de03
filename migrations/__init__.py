"""Alembic revisions of the ledger schema, shipped inside the package so that a plain install can migrate."""
