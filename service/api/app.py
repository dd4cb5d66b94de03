"""The FastAPI application, built by a factory so that settings are read at start, not import."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline

from dpledger.service.api import errors, metrics
from dpledger.service.api.admission import BodyLimit, InFlight
from dpledger.service.api.known import Known
from dpledger.service.api.ledger_file import FileWatch, FileWatchMiddleware, ledger_path
from dpledger.service.api.refusals import RefusalLog
from dpledger.service.api.routes import (
    audit,
    charges,
    checkpoint,
    dashboard,
    jobs,
    keys,
    log,
    quote,
    searches,
    silos,
)
from dpledger.service.ledger import keys as ledger_keys
from dpledger.service.ledger.sequencer import Sequencer
from dpledger.service.ledger.signer import load_signer
from dpledger.service.settings import Settings, get_settings
from dpledger.service.store.db import Database

DOCS_ASSETS = "/docs-assets"


def _operation_id(route: APIRoute) -> str:
    # Stable ids from the route's name, so clients generated from openapi/ do not churn.
    return route.name


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[None]:
        application.state.sequencer.start()  # again, if an earlier lifespan of this app stopped it
        yield
        application.state.sequencer.stop()

    # /docs and /redoc from assets shipped in the fastapi-offline package, not from a CDN: a ledger
    # often runs where the internet is not reachable, and its docs page must not load a third party's script.
    app: FastAPI = FastAPIOffline(
        title="dpledger",
        version="1",
        summary="Privacy budgets for cross-silo federated learning: RDP ledgers, spend approval, audit",
        generate_unique_id_function=_operation_id,
        static_url=DOCS_ASSETS,
        # Swagger UI would otherwise fetch a validity badge from validator.swagger.io.
        swagger_ui_parameters={"validatorUrl": None},
        lifespan=lifespan,
    )
    # Before the database: a configured key that cannot be read stops the start (never a new key).
    app.state.signer = load_signer(settings)
    db = Database.connect(settings.database_url)
    app.state.db = db
    app.state.engine = db.engine
    app.state.refusals = RefusalLog()
    app.state.in_flight = InFlight()  # requests in flight per key on the routes that compute (admission.py)
    app.state.known = Known()  # keys and silos this process has approved for (service/api/known.py)
    # The log's sequencer runs in every serving process; one per database leads (ledger/sequencer.py).
    # Started here, not at the lifespan's start, so that an app driven without one (a test client
    # outside `with`) sequences too; it ends at shutdown, when the engine is disposed, or with the app.
    sequencer = Sequencer(db, app.state.signer, interval=settings.log_sequence_interval_ms / 1000)
    app.state.sequencer = sequencer
    sequencer.start()
    weakref.finalize(app, sequencer.signal_stop)
    if settings.admin_key:
        ledger_keys.ensure_admin_key(db, settings.admin_key)

    errors.install(app)
    _watch_file(app, db, settings.database_url)  # before metrics: its access line and counters see the 503s too
    metrics.install(app)
    app.add_middleware(BodyLimit)  # outermost: a body larger than any request needs is never read
    for module in (silos, charges, jobs, audit, quote, keys, searches, log, checkpoint, dashboard):
        app.include_router(module.router)

    @app.get("/healthz", tags=["health"], name="healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _watch_file(app: FastAPI, db: Database, url: str) -> None:
    """A SQLite ledger: the file opened now is the one served, or nothing is (ledger_file.py)."""
    path = ledger_path(url)
    if path is None:
        return
    with db.engine.connect():  # SQLite creates the file at its first connection: it exists before it is watched
        pass
    app.add_middleware(FileWatchMiddleware, watch=FileWatch.of(path))
