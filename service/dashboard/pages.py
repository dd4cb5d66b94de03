"""The dashboard's HTML pages, as strings. Every value from the database goes through `escape`
(a silo's name is whatever its registrant typed), and nothing is loaded from another host."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from dpledger.service.dashboard import svg
from dpledger.service.dashboard.numbers import exact, shown

STYLESHEET = """
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
header { background: #1f2d3d; color: #fff; padding: 0.6rem 1.2rem; display: flex; align-items: center; gap: 1rem; }
header h1 { font-size: 1.1rem; margin: 0; flex: 1; }
header a { color: #fff; }
header form { margin: 0; }
main { padding: 1rem 1.2rem; }
table { border-collapse: collapse; background: #fff; }
th, td { padding: 0.35rem 0.7rem; border-bottom: 1px solid #ddd; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fdecea; }
.ok { color: #1e8449; font-weight: 600; }
.failed { color: #c0392b; font-weight: 600; }
.message { color: #c0392b; }
form.login { background: #fff; padding: 1rem; display: inline-block; border: 1px solid #ddd; }
form.login input[type=password] { width: 28rem; }
""".strip()

# The page's Content-Security-Policy admits this stylesheet by its digest and nothing else: no
# script, font, image or stylesheet from anywhere, so a name that slipped past escaping still could
# not run or load anything.
STYLE_HASH = "sha256-" + base64.b64encode(hashlib.sha256(STYLESHEET.encode()).digest()).decode()
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; style-src '{STYLE_HASH}'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclass(frozen=True)
class SiloRow:
    id: int
    name: str
    epsilon: float
    delta: float
    epsilon_spent: float | None  # None where the API sends null (an unbounded ε)
    epsilon_committed: float | None
    epsilon_remaining: float


@dataclass(frozen=True)
class ChargeRow:
    id: int
    status: str
    job_id: str | None
    round: int | None
    mechanism_type: str
    epsilon: float | None


@dataclass(frozen=True)
class Verification:
    ok: bool
    entries: int
    bad_charge_ids: list[int]
    problems: list[str]


def _document(title: str, body: str, *, signed_in: bool) -> str:
    logout = (
        '<a href="/dashboard">all silos</a>'
        '<form method="post" action="/dashboard/logout"><button type="submit">Sign out</button></form>'
        if signed_in
        else ""
    )
    return (
        "<!DOCTYPE html>"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)} · dpledger</title><style>{STYLESHEET}</style></head>"
        f"<body><header><h1>dpledger · {escape(title)}</h1>{logout}</header><main>{body}</main></body></html>"
    )


def login(message: str | None = None) -> str:
    notice = f'<p class="message" role="alert">{escape(message)}</p>' if message else ""
    return _document(
        "sign in",
        f"{notice}<p>An admin or auditor API key opens the dashboard; it is kept in an HttpOnly cookie.</p>"
        '<form class="login" method="post" action="/dashboard/login">'
        '<label for="api_key">API key</label><br>'
        '<input id="api_key" name="api_key" type="password" autocomplete="off" required autofocus><br><br>'
        '<button type="submit">Sign in</button></form>',
        signed_in=False,
    )


def problem(title: str, message: str, *, signed_in: bool) -> str:
    return _document(title, f'<p class="message" role="alert">{escape(message)}</p>', signed_in=signed_in)


@dataclass(frozen=True)
class LogView:
    """The transparency log as the overview shows it: its size now, and the last head an auditor verified."""

    size: int
    root_hash: str
    verified_size: int | None
    verified_root: str | None
    verified_signed_at: str | None  # ISO, UTC
    verified_at: str | None
    still_extends: bool | None


def overview(rows: Sequence[SiloRow], log: LogView | None = None) -> str:
    body_rows = "".join(_silo_row(r) for r in rows)
    table = (
        '<table id="silos"><thead><tr><th>name</th><th>id</th><th>ε budget</th><th>δ</th><th>ε spent</th>'
        "<th>ε committed</th><th>ε remaining</th><th>spent share</th></tr></thead>"
        f"<tbody>{body_rows}</tbody></table>"
    )
    caption = f"<p>{len(rows)} silo{'s' if len(rows) != 1 else ''}. ε spent counts committed and reserved charges.</p>"
    return _document("privacy budgets", caption + table + ("" if log is None else _log(log)), signed_in=True)


def _log(log: LogView) -> str:
    now = f"{log.size} entries, root {escape(log.root_hash[:16])}…"
    if log.verified_size is None:
        last = ('<p id="last-verified" data-verified-size="">No auditor has verified a head yet '
                "(<code>dpledger audit --since HEAD_FILE</code>).</p>")
    else:
        state = ('<span class="ok">today\'s log still starts with it</span>' if log.still_extends
                 else '<span class="failed">today\'s log does NOT start with it: the log was rewritten</span>')
        last = (
            f'<p id="last-verified" data-verified-size="{log.verified_size}" '
            f'data-still-extends="{str(log.still_extends).lower()}">'
            f"Last head verified by an auditor: {log.verified_size} entries, root {escape((log.verified_root or '')[:16])}…, "
            f"signed {escape(log.verified_signed_at or '')}, verified {escape(log.verified_at or '')}; {state}.</p>"
        )
    return f'<h2>Transparency log</h2><p id="log-size" data-size="{log.size}">Now: {now}.</p>{last}'



def _silo_row(row: SiloRow) -> str:
    spent = float("inf") if row.epsilon_spent is None else row.epsilon_spent
    return (
        f'<tr data-silo-id="{row.id}">'
        f'<td data-name="{escape(row.name)}"><a href="/dashboard/silos/{row.id}">{escape(row.name)}</a></td>'
        f'<td class="num">{row.id}</td>'
        f'<td class="num" data-epsilon="{exact(row.epsilon)}">{shown(row.epsilon)}</td>'
        f'<td class="num" data-delta="{exact(row.delta)}">{shown(row.delta)}</td>'
        f'<td class="num" data-epsilon-spent="{exact(row.epsilon_spent)}">{_epsilon(row.epsilon_spent)}</td>'
        f'<td class="num" data-epsilon-committed="{exact(row.epsilon_committed)}">{_epsilon(row.epsilon_committed)}</td>'
        f'<td class="num" data-epsilon-remaining="{exact(row.epsilon_remaining)}">{shown(row.epsilon_remaining)}</td>'
        f"<td>{svg.bar(spent=spent, budget=row.epsilon)}</td></tr>"
    )


def silo(row: SiloRow, points: Sequence[svg.Point], charges: Sequence[ChargeRow], verification: Verification) -> str:
    summary = (
        f'<p id="summary" data-silo-id="{row.id}">silo {row.id} · budget ε = {shown(row.epsilon)}, δ = {shown(row.delta)}'
        f" · spent {_epsilon(row.epsilon_spent)} · committed {_epsilon(row.epsilon_committed)}"
        f" · remaining {shown(row.epsilon_remaining)}</p>"
    )
    chart = f'<h2>ε after each ledger entry</h2><figure id="epsilon-chart">{svg.line_chart(points, budget=row.epsilon)}</figure>'
    return _document(
        f"silo {row.name}", summary + _verification(verification) + chart + _charges(charges, verification), signed_in=True
    )


def _verification(v: Verification) -> str:
    if v.ok:
        return (
            '<h2>Chain verification</h2><p id="verification" class="ok" data-ok="true">'
            f"verified: {v.entries} entries, every hash recomputed</p>"
        )
    named = ", ".join(f"charge {c}" for c in v.bad_charge_ids) or "no single charge"
    problems = "".join(f"<li>{escape(p)}</li>" for p in v.problems)
    return (
        '<h2>Chain verification</h2><div id="verification" class="failed" data-ok="false"'
        f' data-bad-charge-ids="{",".join(str(c) for c in v.bad_charge_ids)}">'
        f"<p>verification FAILED: {len(v.problems)} problem{'s' if len(v.problems) != 1 else ''}; altered: {named}</p>"
        f"<ul>{problems}</ul></div>"
    )


def _charges(charges: Sequence[ChargeRow], verification: Verification) -> str:
    if not charges:
        return '<h2>Charges</h2><p id="charges">No charges yet.</p>'
    bad = set(verification.bad_charge_ids)
    rows = "".join(_charge_row(c, bad=c.id in bad) for c in charges)
    return (
        '<h2>Charges</h2><table id="charges"><thead><tr><th>id</th><th>status</th><th>job</th><th>round</th>'
        f"<th>mechanism</th><th>ε of this charge alone</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _charge_row(c: ChargeRow, *, bad: bool) -> str:
    marked = ' class="bad"' if bad else ""
    return (
        f'<tr data-charge-id="{c.id}"{marked}>'
        f'<td class="num">{c.id}</td><td data-status="{escape(c.status)}">{escape(c.status)}</td>'
        f"<td>{'—' if c.job_id is None else escape(c.job_id)}</td>"
        f'<td class="num">{"—" if c.round is None else c.round}</td>'
        f"<td>{escape(c.mechanism_type)}</td>"
        f'<td class="num" data-epsilon="{exact(c.epsilon)}">{_epsilon(c.epsilon)}</td></tr>'
    )


def _epsilon(value: float | None) -> str:
    """An ε the API sends as null is unbounded, not unknown."""
    return shown(float("inf") if value is None else value)
