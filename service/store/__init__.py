"""The ledger's storage: every SQL statement, lock, batching trick and database difference.

The ledger's domain modules (`service/ledger/`: charges, gate, seals, chain, transparency, silos,
sequencer…) decide; this package reads and writes. They hold no SQL and no branch on the database:
they call the functions here with the caller's session, and `tests/service/test_store_boundary.py`
greps for any statement built elsewhere.

Rooms:
- `models`: the schema (SQLAlchemy tables; Alembic's migrations derive from it).
- `db`: engines, sessions, group commit and migrations (`Database`).
- `curves`: the privacy curves, stored once per ledger and named by hash.
- `log`: the transparency log's tables (pending leaves, leaves, nodes, state, heads).
- `records`: jobs, norm reports, privacy levels, API keys, searches, history and audit reads;
  `charges` and `silos`: the reads of those rows outside the approval's statements.
- `reserving`: the approval's statements, one contract (`Reserving`) with one implementation per
  database in `sqlite` and `postgres`; `leadership` and `wakeup`: the sequencer's lock and doorbell,
  per database.
- `sqlite_url`: whether a URL names a SQLite file or memory; `errors`: how each driver says its disk
  is full.
"""
