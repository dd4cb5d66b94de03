"""The dashboard's HTML pages, as strings. Every value from the database goes through `escape`
(a silo's name is whatever its registrant typed), and nothing is loaded from another host."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

from dpledger.service.dashboard import svg
from dpledger.wire.numbers import exact, remaining_shown, shown

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
p.alert { background: #fdecea; border: 1px solid #c0392b; padding: 0.5rem 0.8rem; }
.note { color: #555; font-size: 0.9rem; }
.retired { color: #7d6608; font-weight: 600; }
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
    chain_ok: bool = True  # the silo's hash chain and charges verify
    refusals: int = 0  # refused requests seen by this server process
    epsilon_dp_accounting: float | None = None  # for reference: dp-accounting's non-adaptive ε of what is spent
    tampered: str | None = None  # why the record is refused (seals.Tampered): its numbers are not shown
    retired_seq: int | None = None  # the silo's retire entry: it approves nothing since (ledger/silos.py retire)
    retired_reason: str | None = None


@dataclass(frozen=True)
class ChargeRow:
    id: int
    status: str
    job_id: str | None
    round: int | None
    mechanism_type: str
    epsilon: float | None
    created_at: datetime | None = None
    noise_multiplier: float | None = None  # σ, where the mechanism has one
    sampling_rate: float | None = None  # q, as the service computed it
    steps: int | None = None


@dataclass(frozen=True)
class RefusalSummary:
    """Refusals of one silo seen by this server process since `since` (they are not stored)."""

    since: datetime
    count: int
    last_at: datetime | None = None
    last_job_id: str | None = None
    last_round: int | None = None
    epsilon_spent: float | None = None
    epsilon_if_approved: float | None = None


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


def overview(
    rows: Sequence[SiloRow], *, entries: int, refusals_since: datetime, log: LogView | None = None
) -> str:
    body_rows = "".join(_silo_row(r) for r in rows)
    table = (
        '<table id="silos"><thead><tr><th>name</th><th>id</th><th>ε budget</th><th>δ</th><th>ε spent</th>'
        "<th>ε committed</th><th>ε remaining</th><th>spent share</th><th>hash chain</th><th>refused</th></tr></thead>"
        f"<tbody>{body_rows}</tbody></table>"
    )
    broken = [r for r in rows if not r.chain_ok]
    if broken:
        named = ", ".join(f"{escape(r.name)} (silo {r.id})" for r in broken)
        ids = ",".join(str(r.id) for r in broken)
        chain = (
            f'<p id="chain-status" class="alert failed" role="alert" data-ok="false" data-broken="{ids}">'
            f"Verification FAILED for {len(broken)} silo{'s' if len(broken) != 1 else ''}: {named}. "
            "Its ledger no longer matches its hash chain; open the silo for the problems.</p>"
        )
    else:
        chain = f'<p id="chain-status" class="ok" data-ok="true">Every hash chain verified: {entries} entries recomputed.</p>'
    caption = (
        f"<p>{len(rows)} silo{'s' if len(rows) != 1 else ''}. ε spent counts committed and reserved charges.</p>"
        f'<p class="note">refused: over-budget requests answered by this server process since {_time(refusals_since)}; '
        "a refusal writes nothing to the ledger, so it is counted, not stored.</p>"
    )
    log_part = "" if log is None else _log(log)
    return _document("privacy budgets", chain + caption + table + log_part, signed_in=True)


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



def _remaining(row: SiloRow) -> str:
    return remaining_shown(remaining=row.epsilon_remaining, budget=row.epsilon)


def _silo_row(row: SiloRow) -> str:
    if row.tampered is not None:
        return (
            f'<tr data-silo-id="{row.id}" class="bad" data-tampered="true">'
            f'<td data-name="{escape(row.name)}"><a href="/dashboard/silos/{row.id}">{escape(row.name)}</a></td>'
            f'<td class="num">{row.id}</td><td colspan="6" class="failed">record TAMPERED: {escape(row.tampered)}</td>'
            '<td class="failed" data-chain="broken">BROKEN</td><td class="num">—</td></tr>'
        )
    spent = float("inf") if row.epsilon_spent is None else row.epsilon_spent
    marked = "" if row.chain_ok else ' class="bad"'
    chain = '<td class="ok" data-chain="ok">ok</td>' if row.chain_ok else '<td class="failed" data-chain="broken">BROKEN</td>'
    retired = "" if row.retired_seq is None else (
        f' <span class="retired" data-retired-seq="{row.retired_seq}">retired: {escape(row.retired_reason or "")}</span>'
    )
    return (
        f'<tr data-silo-id="{row.id}"{marked}>'
        f'<td data-name="{escape(row.name)}"><a href="/dashboard/silos/{row.id}">{escape(row.name)}</a>{retired}</td>'
        f'<td class="num">{row.id}</td>'
        f'<td class="num" data-epsilon="{exact(row.epsilon)}">{shown(row.epsilon)}</td>'
        f'<td class="num" data-delta="{exact(row.delta)}">{shown(row.delta)}</td>'
        f'<td class="num" data-epsilon-spent="{exact(row.epsilon_spent)}">{_epsilon(row.epsilon_spent)}</td>'
        f'<td class="num" data-epsilon-committed="{exact(row.epsilon_committed)}">{_epsilon(row.epsilon_committed)}</td>'
        f'<td class="num" data-epsilon-remaining="{exact(row.epsilon_remaining)}">{_remaining(row)}</td>'
        f"<td>{svg.bar(spent=spent, budget=row.epsilon)}</td>{chain}"
        f'<td class="num" data-refusals="{row.refusals}">{row.refusals}</td></tr>'
    )


def silo(
    row: SiloRow, points: Sequence[svg.Point], charges: Sequence[ChargeRow], verification: Verification, refusals: RefusalSummary
) -> str:
    summary = (
        f'<p id="summary" data-silo-id="{row.id}">silo {row.id} · budget ε = {shown(row.epsilon)}, δ = {shown(row.delta)}'
        f" · spent {_epsilon(row.epsilon_spent)} · committed {_epsilon(row.epsilon_committed)}"
        f" · remaining {_remaining(row)}</p>"
        '<p id="reference">ε above is the gate\'s reading: what the ledger charges, proven under adaptive choices. '
        "For reference, dp-accounting's non-adaptive RDP ε of the same spent charges is "
        f'<span data-epsilon-dp-accounting="{exact(row.epsilon_dp_accounting)}">{_epsilon(row.epsilon_dp_accounting)}'
        "</span> (adaptive choices may exceed it).</p>"
    )
    chart = f'<h2>ε after each ledger entry</h2><figure id="epsilon-chart">{svg.line_chart(points, budget=row.epsilon)}</figure>'
    retired = "" if row.retired_seq is None else (
        f'<p id="retired" class="alert" data-retired-seq="{row.retired_seq}">This silo is retired (entry {row.retired_seq}: '
        f"{escape(row.retired_reason or '')}): it approves nothing. Its reservations made before are still settled, and "
        "nothing it spent was refunded.</p>"
    )
    body = retired + summary + _verification(verification) + _refusals(refusals) + chart + _charges(charges, verification)
    return _document(f"silo {row.name}", body, signed_in=True)


def tampered(silo_id: int, message: str, verification: Verification) -> str:
    """A silo whose record no longer matches the entries that cover it: named, with the chain check's
    findings, and no number read from the edited row."""
    body = (f'<p id="tampered" class="alert failed" role="alert" data-silo-id="{silo_id}">{escape(message)}</p>'
            + _verification(verification))
    return _document(f"silo {silo_id}: record tampered", body, signed_in=True)


def _refusals(r: RefusalSummary) -> str:
    since = f"since {_time(r.since)} (this server process; a refusal writes nothing to the ledger, so it is counted, not stored)"
    if r.count == 0:
        return f'<h2>Refusals</h2><p id="refusals" data-count="0">No request refused {since}.</p>'
    where = "".join([
        "" if r.last_job_id is None else f" of job {escape(r.last_job_id)}",
        "" if r.last_round is None else f", round {r.last_round + 1}",  # the API's index from 0, read from 1
    ])
    return (
        f'<h2>Refusals</h2><p id="refusals" data-count="{r.count}">{r.count} request{"s" if r.count != 1 else ""} '
        f"refused {since}. The last, at {_time(r.last_at)}{where}, would have taken ε from "
        f'{_epsilon(r.epsilon_spent)} to <span data-epsilon-if-approved="{exact(r.epsilon_if_approved)}">'
        f"{_epsilon(r.epsilon_if_approved)}</span>, over the budget.</p>"
    )


def _time(value: datetime | None) -> str:
    return "—" if value is None else escape(value.strftime("%Y-%m-%d %H:%M:%S %Z").strip())


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
        '<h2>Charges</h2><table id="charges"><thead><tr><th>id</th><th>reserved at</th><th>status</th><th>job</th>'
        "<th>round</th><th>mechanism</th><th>σ</th><th>q</th><th>steps</th><th>ε of this charge alone</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _charge_row(c: ChargeRow, *, bad: bool) -> str:
    marked = ' class="bad"' if bad else ""
    return (
        f'<tr data-charge-id="{c.id}"{marked}>'
        f'<td class="num">{c.id}</td><td data-created-at="{"" if c.created_at is None else c.created_at.isoformat()}">'
        f"{_time(c.created_at)}</td>"
        f'<td data-status="{escape(c.status)}">{escape(c.status)}</td>'
        f"<td>{'—' if c.job_id is None else escape(c.job_id)}</td>"
        f'<td class="num">{"—" if c.round is None else c.round + 1}</td>'
        f"<td>{escape(c.mechanism_type)}</td>"
        f'<td class="num" data-sigma="{exact(c.noise_multiplier)}">{shown(c.noise_multiplier)}</td>'
        f'<td class="num" data-q="{exact(c.sampling_rate)}">{shown(c.sampling_rate)}</td>'
        f'<td class="num" data-steps="{"null" if c.steps is None else c.steps}">{"—" if c.steps is None else c.steps}</td>'
        f'<td class="num" data-epsilon="{exact(c.epsilon)}">{_epsilon(c.epsilon)}</td></tr>'
    )


def _epsilon(value: float | None) -> str:
    """An ε the API sends as null is unbounded, not unknown."""
    return shown(float("inf") if value is None else value)
