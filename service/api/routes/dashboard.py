"""The auditors' dashboard over HTTP: a cookie sign-in, then HTML pages built from the same ledger
calls as the JSON API. Left out of the OpenAPI document, which describes the JSON API only."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Cookie, Depends, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from dpledger.service.api.deps import READERS, DbDep, IdPath, Principal
from dpledger.service.api.refusals import RefusalLog
from dpledger.service.dashboard import pages, series
from dpledger.service.dashboard.parameters import parameters
from dpledger.service.ledger import audit, gate, keys, seals, silos, transparency
from dpledger.service.ledger import history as ledger_history
from dpledger.service.ledger.errors import NotFound
from dpledger.service.store.models import Role, Silo
from dpledger.wire.schemas import finite_or_none

router = APIRouter(prefix="/dashboard", include_in_schema=False)

COOKIE = "dpledger_dashboard_key"
LOGIN_PATH = "/dashboard/login"
_MAX_FORM_BYTES = 4096  # an API key is ~50 characters; nothing legitimate posts more


def _html(body: str, status_code: int = status.HTTP_200_OK) -> HTMLResponse:
    # The pages show budgets: never cached, never framed, and allowed to load nothing from anywhere.
    return HTMLResponse(
        body,
        status_code=status_code,
        headers={
            "Content-Security-Policy": pages.CONTENT_SECURITY_POLICY,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


def _reader(db: DbDep, key: Annotated[str | None, Cookie(alias=COOKIE)] = None) -> Principal | None:
    """The signed-in reader, checked again on every page, so a key revoked since sign-in stops
    working at once; None sends the visitor to the sign-in page."""
    if not key:
        return None
    with db.read() as session:
        found = keys.authenticate(session, key)
    if found is None or Role(found.role) not in READERS:
        return None
    return Principal(key_id=found.id, role=Role(found.role), silo_id=found.silo_id)


ReaderDep = Annotated[Principal | None, Depends(_reader)]


def _to_login() -> Response:
    response = RedirectResponse(LOGIN_PATH, status_code=status.HTTP_303_SEE_OTHER)
    response.delete_cookie(COOKIE, path="/dashboard", httponly=True, samesite="strict")
    return response


@router.get("/login", name="dashboard_login_form")
def login_form() -> HTMLResponse:
    return _html(pages.login())


@router.post("/login", name="dashboard_login")
async def login(request: Request, db: DbDep) -> Response:
    body = await request.body()
    if len(body) > _MAX_FORM_BYTES:
        return _html(pages.login("That form is too large to be a sign-in."), status.HTTP_413_CONTENT_TOO_LARGE)
    # urlencoded by hand: the one field does not justify the python-multipart dependency.
    raw = parse_qs(body.decode("utf-8", errors="replace")).get("api_key", [""])[0].strip()
    if not raw:
        return _html(pages.login("Enter an API key."), status.HTTP_401_UNAUTHORIZED)
    with db.read() as session:
        key = keys.authenticate(session, raw)
    if key is None:
        return _html(pages.login("Unknown or revoked API key."), status.HTTP_401_UNAUTHORIZED)
    role = Role(key.role)
    if role not in READERS:
        message = (
            f"A key of role '{role.value}' may not open the dashboard: "
            "it shows every silo's budget, so only admin and auditor keys may."
        )
        return _html(pages.problem("not allowed", message, signed_in=False), status.HTTP_403_FORBIDDEN)
    response = RedirectResponse("/dashboard", status_code=status.HTTP_303_SEE_OTHER)
    # HttpOnly: no script can read the key; SameSite=Strict: no other site's form can post with it.
    response.set_cookie(
        COOKIE, raw, httponly=True, samesite="strict", secure=request.url.scheme == "https", path="/dashboard"
    )
    return response


@router.post("/logout", name="dashboard_logout")
def logout() -> Response:
    return _to_login()


def _row(silo: Silo, *, chain_ok: bool = True, refusals: int = 0) -> pages.SiloRow:
    # The same calls and the same null-for-∞ as GET /v1/silos/{id}, so page and API agree exactly.
    budget = silos.status(silo)
    return pages.SiloRow(
        id=silo.id, name=silo.name, epsilon=silo.epsilon, delta=silo.delta,
        epsilon_spent=finite_or_none(budget.epsilon_spent),
        epsilon_committed=finite_or_none(budget.epsilon_committed),
        epsilon_remaining=budget.epsilon_remaining, chain_ok=chain_ok, refusals=refusals,
        epsilon_dp_accounting=finite_or_none(ledger_history.dp_accounting_epsilon(silo)),
        retired_seq=silo.retired_seq, retired_reason=silo.retired_reason,
    )


def _refusals(request: Request) -> RefusalLog:
    refusals: RefusalLog = request.app.state.refusals
    return refusals


@router.get("", name="dashboard_overview")
def overview(request: Request, reader: ReaderDep, db: DbDep) -> Response:
    if reader is None:
        return _to_login()
    log = _refusals(request)
    rows, entries = [], 0
    with db.read() as session:
        for silo in silos.list_all(session):
            # Every chain recomputed on every visit: a broken one must show on the first page an
            # auditor sees, not only on the silo's own page.
            report = audit.verify(session, silo_ids=[silo.id])
            entries += report.entries
            refused = log.of(silo.id)
            try:
                seals.check(session, silo)  # an edited record is named, never read as if it were sound
            except seals.Tampered as error:
                rows.append(pages.SiloRow(id=silo.id, name=silo.name, epsilon=silo.epsilon, delta=silo.delta,
                                          epsilon_spent=None, epsilon_committed=None, epsilon_remaining=0.0,
                                          chain_ok=False, tampered=str(error)))
                continue
            rows.append(_row(silo, chain_ok=report.ok, refusals=0 if refused is None else refused.count))
        log_view = _log_view(transparency.summary(session))
    return _html(pages.overview(rows, entries=entries, refusals_since=log.since, log=log_view))


def _log_view(summary: transparency.LogSummary) -> pages.LogView:
    last = summary.last_verified

    def iso(value: datetime) -> str:
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC).isoformat(timespec="seconds")

    return pages.LogView(
        size=summary.size, root_hash=summary.root_hash,
        verified_size=None if last is None else last.tree_size,
        verified_root=None if last is None else last.root_hash,
        verified_signed_at=None if last is None else iso(datetime.fromtimestamp(last.signed_at / 1000, UTC)),
        verified_at=None if last is None else iso(last.verified_at),
        still_extends=summary.still_extends,
    )


@router.get("/silos/{silo_id}", name="dashboard_silo")
def silo_page(silo_id: IdPath, request: Request, reader: ReaderDep, db: DbDep) -> Response:
    if reader is None:
        return _to_login()
    with db.read() as session:
        try:
            silo = silos.get(session, silo_id)
        except NotFound as error:
            return _html(pages.problem("not found", str(error), signed_in=True), status.HTTP_404_NOT_FOUND)
        except seals.Tampered as error:
            # The page an auditor opens precisely then: the tampered record named, and what the chain check finds.
            report = audit.verify(session, silo_ids=[silo_id])
            verification = pages.Verification(ok=report.ok, entries=report.entries,
                                              bad_charge_ids=report.bad_charge_ids, problems=report.problems)
            return _html(pages.tampered(silo_id, str(error), verification), status.HTTP_409_CONFLICT)
        history = ledger_history.history(session, silo_id, limit=1_000_000)
        report = audit.verify(session, silo_ids=[silo_id])
        row = _row(silo, chain_ok=report.ok)
        steps = [
            series.Step(seq=h.entry.seq, event=h.entry.event, charge_rdp=None if h.charge is None else h.charge.rdp,
                        epsilon_spent=h.entry.epsilon_spent, epsilon_dp_accounting=h.epsilon_dp_accounting)
            for h in history
        ]
        charge_rows = _charge_rows(history, delta=silo.delta)
    verification = pages.Verification(
        ok=report.ok, entries=report.entries, bad_charge_ids=report.bad_charge_ids, problems=report.problems
    )
    log = _refusals(request)
    refused = log.of(silo_id)
    refusals = pages.RefusalSummary(since=log.since, count=0) if refused is None else pages.RefusalSummary(
        since=log.since, count=refused.count, last_at=refused.last.at, last_job_id=refused.last.job_id,
        last_round=refused.last.round, epsilon_spent=refused.last.epsilon_spent,
        epsilon_if_approved=refused.last.epsilon_if_approved,
    )
    points = series.points(steps, convert=lambda running: gate.reading(silo, running).epsilon)
    return _html(pages.silo(row, points, charge_rows, verification, refusals))


def _charge_rows(history: list[ledger_history.HistoryRow], *, delta: float) -> list[pages.ChargeRow]:
    """One row per charge in the silo's history (its reserve entry names it first), by id."""
    rows: dict[int, pages.ChargeRow] = {}
    for h in history:
        c = h.charge
        if c is not None and c.id not in rows:
            shown = parameters(c.mechanism)
            rows[c.id] = pages.ChargeRow(
                id=c.id, status=c.status, job_id=c.job_id, round=c.round,
                mechanism_type=_mechanism_type(c.mechanism),
                epsilon=finite_or_none(series.charge_epsilon(c.rdp, delta=delta)),
                created_at=c.created_at, noise_multiplier=shown.noise_multiplier,
                sampling_rate=shown.sampling_rate, steps=shown.steps,
            )
    return sorted(rows.values(), key=lambda r: r.id)


def _mechanism_type(stored: str) -> str:
    # An auditor opens this page precisely when rows may have been edited: show what is there.
    try:
        kind = json.loads(stored).get("type")
    except (ValueError, AttributeError):
        return "unreadable mechanism"
    return kind if isinstance(kind, str) else "unreadable mechanism"
