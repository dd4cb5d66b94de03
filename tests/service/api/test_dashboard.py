"""The auditors' dashboard through the real app: sign-in, the numbers it shows against the JSON
API's, the chain verification of a silo, escaping, and no dependency on any other host."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import ADMIN

STEP = {"type": "dpsgd", "batch_size": 10, "noise_multiplier": 1.1, "steps": 5}
FORM = {"content-type": "application/x-www-form-urlencoded"}
COOKIE = "dpledger_dashboard_key"


class _Elements(HTMLParser):
    """Every start tag with its attributes, by a real HTML parser rather than regular expressions."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def elements(html: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Elements()
    parser.feed(html)
    return parser.tags


def new_key(client, role: str, silo_id: int | None = None) -> str:  # type: ignore[no-untyped-def]
    body = {"role": role} if silo_id is None else {"role": role, "silo_id": silo_id}
    response = client.post("/v1/keys", json=body, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()["api_key"]


def sign_in(client, key: str):  # type: ignore[no-untyped-def]
    return client.post("/dashboard/login", content=f"api_key={key}", headers=FORM, follow_redirects=False)


def charge(client, silo, key: str, round: int) -> int:  # type: ignore[no-untyped-def]
    body = {"mechanism": STEP, "idempotency_key": key, "job_id": "job-7", "round": round}
    response = client.post(f"/v1/silos/{silo.id}/charges", json=body, headers=silo.headers)
    assert response.status_code == 201, response.text
    return response.json()["charge_id"]


@pytest.fixture
def auditor(client) -> str:  # type: ignore[no-untyped-def]
    key = new_key(client, "auditor")
    assert sign_in(client, key).status_code == 303
    return key


@pytest.fixture
def ledger(client, make_silo):  # type: ignore[no-untyped-def]
    """Three silos: one untouched, one with reserved and committed charges, one with a release."""
    silos = [make_silo(epsilon=5.0), make_silo(epsilon=10.0, delta=1e-6), make_silo(epsilon=3.0)]
    ids = [charge(client, silos[1], f"r{i}", i) for i in range(3)]
    assert client.post(f"/v1/charges/{ids[0]}/commit", headers=silos[1].headers).status_code == 200
    assert client.post(f"/v1/charges/{ids[1]}/commit", headers=silos[1].headers).status_code == 200
    released = charge(client, silos[2], "x", 0)
    charge(client, silos[2], "y", 1)
    assert client.post(f"/v1/charges/{released}/release", headers=silos[2].headers).status_code == 200
    return silos, ids


def test_without_a_cookie_every_page_redirects_to_the_sign_in_form(client, make_silo) -> None:
    silo = make_silo()
    for path in ("/dashboard", f"/dashboard/silos/{silo.id}"):
        response = client.get(path, follow_redirects=False)
        assert response.status_code == 303
        assert response.headers["location"] == "/dashboard/login"
    form = client.get("/dashboard/login")
    assert form.status_code == 200
    assert form.headers["content-type"].startswith("text/html")
    assert ("input", {"id": "api_key", "name": "api_key", "type": "password", "autocomplete": "off", "required": None,
                      "autofocus": None}) in elements(form.text)


def test_sign_in_refuses_silo_and_coordinator_keys_and_unknown_ones(client, make_silo) -> None:
    silo = make_silo()
    for role, silo_id in (("silo", silo.id), ("coordinator", None)):
        refused = sign_in(client, new_key(client, role, silo_id))
        assert refused.status_code == 403
        assert f"A key of role &#x27;{role}&#x27; may not open the dashboard" in refused.text
        assert "set-cookie" not in refused.headers
    unknown = sign_in(client, "dpl_not-a-key")
    assert unknown.status_code == 401
    assert "Unknown or revoked API key." in unknown.text
    assert "set-cookie" not in unknown.headers
    assert client.get("/dashboard", follow_redirects=False).status_code == 303


def test_an_auditor_key_signs_in_with_an_http_only_strict_cookie(client) -> None:
    key = new_key(client, "auditor")

    response = sign_in(client, key)

    assert response.status_code == 303
    assert response.headers["location"] == "/dashboard"
    cookie = response.headers["set-cookie"]
    attributes = {part.strip().split("=")[0].lower(): part.strip() for part in cookie.split(";")}
    assert cookie.startswith(f"{COOKIE}={key};")
    assert "httponly" in attributes
    assert attributes["samesite"].lower() == "samesite=strict"
    assert attributes["path"] == "Path=/dashboard"
    assert client.get("/dashboard").status_code == 200


def test_sign_out_clears_the_cookie_and_a_revoked_key_stops_working(client) -> None:
    created = client.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()
    assert sign_in(client, created["api_key"]).status_code == 303
    assert client.get("/dashboard", follow_redirects=False).status_code == 200

    out = client.post("/dashboard/logout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/dashboard/login"
    assert client.get("/dashboard", follow_redirects=False).status_code == 303

    assert sign_in(client, created["api_key"]).status_code == 303
    assert client.delete(f"/v1/keys/{created['key_id']}", headers=ADMIN).status_code == 204
    assert client.get("/dashboard", follow_redirects=False).status_code == 303


def _overview_rows(html: str) -> dict[int, dict[str, str | None]]:
    """silo id → the data- attributes of its row's cells."""
    rows: dict[int, dict[str, str | None]] = {}
    current: int | None = None
    for tag, attrs in elements(html):
        if tag == "tr" and attrs.get("data-silo-id"):
            current = int(attrs["data-silo-id"])  # type: ignore[arg-type]
            rows[current] = {}
        elif tag == "td" and current is not None:
            rows[current].update({k: v for k, v in attrs.items() if k.startswith("data-")})
    return rows


def test_the_overview_shows_every_silo_with_the_apis_numbers(client, ledger, auditor) -> None:
    silos, _ = ledger
    page = client.get("/dashboard")
    assert page.status_code == 200
    rows = _overview_rows(page.text)

    assert sorted(rows) == sorted(s.id for s in silos)
    for silo in silos:
        api = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
        shown = rows[silo.id]
        assert shown["data-name"] == api["name"]
        for field in ("epsilon", "delta", "epsilon_spent", "epsilon_committed", "epsilon_remaining"):
            assert json.loads(shown[f"data-{field.replace('_', '-')}"]) == api[field], field  # type: ignore[arg-type]
        # 6 significant digits on screen, the exact value in the attribute
        assert f">{api['epsilon_spent']:.6g}</td>" in page.text
    assert json.loads(rows[silos[0].id]["data-epsilon-spent"]) == 0.0  # type: ignore[arg-type]
    assert json.loads(rows[silos[1].id]["data-epsilon-spent"]) > json.loads(rows[silos[1].id]["data-epsilon-committed"])  # type: ignore[arg-type]
    shares = [float(a["data-share"]) for t, a in elements(page.text) if t == "svg" and a.get("class") == "bar"]  # type: ignore[arg-type]
    expected = [client.get(f"/v1/silos/{s.id}", headers=ADMIN).json()["epsilon_spent"] / s.epsilon for s in silos]
    assert shares == pytest.approx(expected, rel=1e-12)


def test_the_silo_page_shows_its_charges_chart_and_a_verified_chain(client, ledger, auditor) -> None:
    silos, ids = ledger
    silo = silos[1]
    history = client.get(f"/v1/silos/{silo.id}/history", headers=ADMIN).json()

    page = client.get(f"/dashboard/silos/{silo.id}")

    assert page.status_code == 200
    tags = elements(page.text)
    charge_rows = [int(a["data-charge-id"]) for t, a in tags if t == "tr" and a.get("data-charge-id")]  # type: ignore[arg-type]
    assert charge_rows == ids
    statuses = [a["data-status"] for t, a in tags if t == "td" and "data-status" in a]
    assert statuses == ["committed", "committed", "reserved"]
    assert page.text.count("<td>job-7</td>") == 3 and page.text.count("<td>dpsgd</td>") == 3
    verification = next(a for t, a in tags if a.get("id") == "verification")
    assert verification["data-ok"] == "true"
    assert f"verified: {len(history)} entries" in page.text

    chart = next(a for t, a in tags if t == "svg" and a.get("class") == "line-chart")
    assert chart["data-points"] == str(len(history)) == "6"  # genesis, 3 reserves, 2 commits
    spent = [(int(a["data-seq"]), json.loads(a["data-epsilon"])) for t, a in tags if a.get("class") == "point-spent"]  # type: ignore[arg-type]
    assert spent == [(e["seq"], e["epsilon_spent"]) for e in history]
    committed = [json.loads(a["data-epsilon"]) for t, a in tags if a.get("class") == "point-committed"]  # type: ignore[arg-type]
    api = client.get(f"/v1/silos/{silo.id}", headers=ADMIN).json()
    assert committed[0] == 0.0 and committed[-1] == pytest.approx(api["epsilon_committed"], rel=1e-12)
    assert committed == sorted(committed) and committed[1] == committed[3] == 0.0  # nothing committed before seq 5
    # dp-accounting's non-adaptive ε beside the gate's, labelled as a reference: the history's numbers.
    reference = [(int(a["data-seq"]), json.loads(a["data-epsilon"])) for t, a in tags if a.get("class") == "point-reference"]  # type: ignore[arg-type]
    assert reference == [(e["seq"], e["epsilon_dp_accounting"]) for e in history]
    assert all(r <= s for (_, r), (_, s) in zip(reference, spent, strict=True))
    shown = next(a for t, a in tags if "data-epsilon-dp-accounting" in a)
    assert json.loads(shown["data-epsilon-dp-accounting"]) == api["epsilon_dp_accounting"]  # type: ignore[arg-type]
    assert "dp-accounting ε (reference)" in page.text and "gate's reading" in page.text


def test_the_silo_page_names_a_tampered_charge(client, ledger, auditor, database_url) -> None:
    silos, ids = ledger
    target = ids[2]
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE charges SET job_id = 'forged-job' WHERE id = :id"), {"id": target})
    engine.dispose()

    page = client.get(f"/dashboard/silos/{silos[1].id}")

    assert page.status_code == 200
    tags = elements(page.text)
    verification = next(a for t, a in tags if a.get("id") == "verification")
    assert verification["data-ok"] == "false"
    assert verification["data-bad-charge-ids"] == str(target)
    assert f"altered: charge {target}</p>" in page.text
    assert ("tr", {"data-charge-id": str(target), "class": "bad"}) in tags
    # the other silos' chains are untouched and their pages still say so
    other = elements(client.get(f"/dashboard/silos/{silos[2].id}").text)
    assert next(a for t, a in other if a.get("id") == "verification")["data-ok"] == "true"


def test_a_silo_name_is_escaped_everywhere(client, make_silo, auditor) -> None:
    silo = make_silo(name="<script>alert(1)</script>")

    for path in ("/dashboard", f"/dashboard/silos/{silo.id}"):
        page = client.get(path).text
        assert "<script" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_pages_load_nothing_from_another_host(client, ledger, auditor) -> None:
    silos, _ = ledger
    for path in ("/dashboard/login", "/dashboard", f"/dashboard/silos/{silos[1].id}"):
        response = client.get(path)
        assert response.status_code == 200
        links = [v for _, attrs in elements(response.text) for k, v in attrs.items() if k in ("src", "href", "action") and v]
        assert links, path
        assert all(re.match(r"^/(?!/)", link) for link in links), links
        assert "<script" not in response.text and "<link" not in response.text and "@import" not in response.text
        csp = response.headers["content-security-policy"]
        assert csp.startswith("default-src 'none'; style-src 'sha256-")


def test_an_unknown_silo_is_a_404_page(client, auditor) -> None:
    response = client.get("/dashboard/silos/4242")
    assert response.status_code == 404
    assert "silo 4242 not found" in response.text


def test_the_dashboard_is_not_in_the_openapi_document(client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/dashboard")]


def test_the_overview_flags_a_broken_chain_and_counts_refusals_and_charges_show_time_sigma_q_steps(
    client, ledger, auditor, database_url  # type: ignore[no-untyped-def]
) -> None:
    """An edited charge shows on the first page; a refused request is counted on both pages (it writes
    nothing to the ledger); every charge row carries its time, σ, q (computed by the service) and steps."""
    import re as re_

    from sqlalchemy import create_engine as create_engine_
    from sqlalchemy import text as text_

    page = client.get("/dashboard").text
    assert 'id="chain-status" class="ok" data-ok="true"' in page

    body = {"name": "edited", "epsilon": 5.0, "delta": 1e-5, "dataset_size": 1000}
    silo = client.post("/v1/silos", json=body, headers=ADMIN).json()
    own = {"Authorization": f"Bearer {silo['api_key']}"}
    step = {"type": "dpsgd", "batch_size": 50, "noise_multiplier": 1.3, "steps": 7}
    first = {"mechanism": step, "idempotency_key": "a", "job_id": "j", "round": 0}
    reserved = client.post(f"/v1/silos/{silo['id']}/charges", json=first, headers=own)
    assert reserved.status_code == 201
    huge = {"type": "dpsgd", "batch_size": 500, "noise_multiplier": 0.5, "steps": 1000}
    for attempt in range(2):
        body = {"mechanism": huge, "idempotency_key": f"r{attempt}", "job_id": "j", "round": 1 + attempt}
        refused = client.post(f"/v1/silos/{silo['id']}/charges", json=body, headers=own)
        assert refused.status_code == 409

    detail = client.get(f"/dashboard/silos/{silo['id']}").text
    row = re_.search(rf'<tr data-charge-id="{reserved.json()["charge_id"]}".*?</tr>', detail).group(0)
    assert 'data-sigma="1.3"' in row and 'data-q="0.05"' in row and 'data-steps="7"' in row
    created = re_.search(r'data-created-at="([^"]+)"', row).group(1)
    history = client.get(f"/v1/silos/{silo['id']}/history", headers=ADMIN).json()
    assert created.replace("+00:00", "") == history[1]["created_at"].replace("Z", "").replace("+00:00", "")
    # The last refusal's round index is 2: a person reads it as round 3, as every other line counts.
    assert 'id="refusals" data-count="2"' in detail and "of job j, round 3" in detail

    overview = client.get("/dashboard").text
    silo_row = re_.search(rf'<tr data-silo-id="{silo["id"]}".*?</tr>', overview).group(0)
    assert 'data-refusals="2"' in silo_row and 'data-chain="ok"' in silo_row

    engine = create_engine_(database_url)
    with engine.begin() as connection:
        connection.execute(text_("UPDATE charges SET job_id = 'edited' WHERE id = :id"), {"id": reserved.json()["charge_id"]})
    engine.dispose()
    overview = client.get("/dashboard").text
    assert f'id="chain-status" class="alert failed" role="alert" data-ok="false" data-broken="{silo["id"]}"' in overview
    assert "Verification FAILED for 1 silo: edited (silo" in overview
    silo_row = re_.search(rf'<tr data-silo-id="{silo["id"]}" class="bad">.*?</tr>', overview).group(0)
    assert 'data-chain="broken"' in silo_row


@pytest.mark.parametrize(("stored", "expected"), [
    ('{"type": "dpsgd", "noise_multiplier": 1.1, "sampling_rate": 0.02, "steps": 10, "batch_size": 20}', (1.1, 0.02, 10)),
    ('{"type": "poisson_sampled", "sampling_rate": 0.5, "event": {"type": "gaussian", "noise_multiplier": 2.0}}', (2.0, 0.5, 1)),
    ('{"type": "self_composed", "count": 3, "event": '
     '{"type": "dpsgd", "noise_multiplier": 1.0, "sampling_rate": 0.1, "steps": 4}}', (1.0, 0.1, 12)),
    ('{"type": "gaussian", "noise_multiplier": 4.0}', (4.0, None, 1)),
    ('{"type": "composed", "events": [{"type": "gaussian", "noise_multiplier": 4.0}]}', (None, None, None)),
    ('{"type": "laplace", "noise_multiplier": 1.0}', (None, None, None)),
    ('{"type": "dpsgd", "noise_multiplier": "1.1", "steps": true}', (None, None, None)),
    ("not json", (None, None, None)),
])
def test_charge_parameters_are_read_only_from_shapes_with_one_sigma_and_one_q(stored: str, expected: tuple) -> None:  # type: ignore[type-arg]
    from dpledger.service.dashboard.parameters import parameters

    found = parameters(stored)
    assert (found.noise_multiplier, found.sampling_rate, found.steps) == expected


@pytest.mark.parametrize("edit", ["UPDATE silos SET epsilon = 6.0 WHERE id = :i",
                                  "UPDATE silos SET filter_spec = 'garbage' WHERE id = :i"])
def test_a_tampered_silo_is_named_on_both_pages_and_no_number_is_read_from_its_row(
    client, ledger, auditor, database_url: str, edit: str
) -> None:
    silos, _ = ledger
    target = silos[1]
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text(edit), {"i": target.id})
    engine.dispose()
    detail = client.get(f"/v1/silos/{target.id}", headers=ADMIN)
    assert detail.status_code == 409

    overview = client.get("/dashboard")
    assert overview.status_code == 200
    row = re.search(rf'<tr data-silo-id="{target.id}".*?</tr>', overview.text).group(0)  # type: ignore[union-attr]
    assert 'data-tampered="true"' in row and "record TAMPERED" in row and "data-epsilon-spent" not in row
    assert 'data-chain="broken"' in row
    others = [s.id for s in silos if s.id != target.id]
    for other in others:  # the other silos are shown as before
        assert re.search(rf'<tr data-silo-id="{other}"[^>]*>.*?data-epsilon-spent=', overview.text)

    page = client.get(f"/dashboard/silos/{target.id}")
    assert page.status_code == 409 and page.headers["content-type"].startswith("text/html")
    named = next(a for t, a in elements(page.text) if a.get("id") == "tampered")
    assert named["data-silo-id"] == str(target.id)
    assert detail.json()["detail"].split(":")[0] in html.unescape(page.text)  # the API's own words, escaped
    assert 'id="verification"' in page.text
