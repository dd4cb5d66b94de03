"""The dashboard in a real headless Chromium against a real uvicorn: sign in through the form, read
the numbers through the DOM, compare them with the JSON API, open a silo's chart, screenshot it.

Skipped where Debian's chromium or the playwright package is missing (.ci/run installs both)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from dpledger.harness import running_server
from tests.conftest import ADMIN_KEY

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is absent (pip install playwright)")

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
STEP = {"type": "dpsgd", "batch_size": 20, "noise_multiplier": 1.0, "steps": 10}
# (name, ε, rounds charged, how many of them committed)
SILOS = [("hospital-a", 4.0, 3, 2), ("bank-b", 8.0, 5, 3), ("school-c", 2.0, 0, 0)]


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/l.db"


@pytest.fixture
def server(database_url: str) -> Iterator[str]:
    with running_server(database_url=database_url, admin_key=ADMIN_KEY) as url:
        yield url


def populate(api: httpx.Client) -> list[int]:
    ids = []
    for name, epsilon, rounds, committed in SILOS:
        silo = api.post("/v1/silos", json={"name": name, "epsilon": epsilon, "delta": 1e-5, "dataset_size": 2000}, headers=ADMIN)
        assert silo.status_code == 201, silo.text
        own = {"Authorization": f"Bearer {silo.json()['api_key']}"}
        if name == "school-c":
            refuse_once(api, silo.json()["id"], silo.json()["api_key"])
        for i in range(rounds):
            body = {"mechanism": STEP, "idempotency_key": f"round-{i}", "job_id": "job-1", "round": i}
            reserved = api.post(f"/v1/silos/{silo.json()['id']}/charges", json=body, headers=own)
            assert reserved.status_code == 201, reserved.text
            if i < committed:
                assert api.post(f"/v1/charges/{reserved.json()['charge_id']}/commit", headers=own).status_code == 200
        ids.append(silo.json()["id"])
    return ids


def refuse_once(api: httpx.Client, silo_id: int, key: str) -> None:
    huge = {"type": "dpsgd", "batch_size": 1000, "noise_multiplier": 0.5, "steps": 1000}
    body = {"mechanism": huge, "idempotency_key": "too-much", "job_id": "job-2", "round": 0}
    assert api.post(f"/v1/silos/{silo_id}/charges", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 409


def test_an_auditor_reads_the_apis_numbers_and_a_silos_chart_in_chromium(server: str, database_url: str, tmp_path: Path) -> None:
    # DPLEDGER_SCREENSHOTS=folder keeps the screenshots for a person to look at.
    shots = Path(os.environ.get("DPLEDGER_SCREENSHOTS", tmp_path))
    with httpx.Client(base_url=server, timeout=30) as api:
        ids = populate(api)
        auditor_key = api.post("/v1/keys", json={"role": "auditor"}, headers=ADMIN).json()["api_key"]
        expected = {i: api.get(f"/v1/silos/{i}", headers=ADMIN).json() for i in ids}
        history = api.get(f"/v1/silos/{ids[1]}/history", headers=ADMIN).json()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            # A CSP violation (a blocked stylesheet, say) shows up as a console error.
            console_errors: list[str] = []
            page.on("console", lambda message: console_errors.append(message.text) if message.type == "error" else None)

            page.goto(f"{server}/dashboard")
            assert page.url == f"{server}/dashboard/login"
            page.fill("#api_key", auditor_key)
            page.click("button[type=submit]")
            page.wait_for_url(f"{server}/dashboard")

            rows = page.locator("tr[data-silo-id]")
            assert rows.count() == len(SILOS)
            for index, silo_id in enumerate(ids):
                row = page.locator(f'tr[data-silo-id="{silo_id}"]')
                api_silo = expected[silo_id]
                assert row.locator("td[data-name]").inner_text() == api_silo["name"] == SILOS[index][0]
                for field in ("epsilon", "delta", "epsilon_spent", "epsilon_committed", "epsilon_remaining"):
                    cell = row.locator(f"td[data-{field.replace('_', '-')}]")
                    assert json.loads(cell.get_attribute(f"data-{field.replace('_', '-')}") or "") == api_silo[field], field
                assert row.locator("td[data-epsilon-spent]").inner_text() == f"{api_silo['epsilon_spent']:.6g}"
                bar = row.locator("svg.bar rect.bar-spent")
                assert float(bar.get_attribute("width") or "") == pytest.approx(
                    160 * api_silo["epsilon_spent"] / api_silo["epsilon"], abs=0.01
                )
            assert expected[ids[2]]["epsilon_spent"] == 0.0 and expected[ids[1]]["epsilon_spent"] > 0.0

            # The inline stylesheet applied: its CSP hash matches what the page sends.
            header_colour = page.locator("header").evaluate("element => getComputedStyle(element).backgroundColor")
            assert header_colour == "rgb(31, 45, 61)"
            assert page.locator("#chain-status").get_attribute("data-ok") == "true"
            assert [page.locator(f'tr[data-silo-id="{i}"] td[data-refusals]').inner_text() for i in ids] == ["0", "0", "1"]
            page.screenshot(path=str(shots / "overview.png"), full_page=True)

            page.click("text=bank-b")
            page.wait_for_url(f"{server}/dashboard/silos/{ids[1]}")
            chart = page.locator("svg.line-chart")
            assert chart.is_visible()
            # create, the filter its first charge fixed, then its charges
            assert chart.get_attribute("data-points") == str(len(history)) == str(1 + 1 + 5 + 3)
            assert page.locator("svg.line-chart circle.point-spent").count() == len(history)
            assert page.locator("svg.line-chart circle.point-committed").count() == len(history)
            points = (page.locator("svg.line-chart polyline.series-spent").get_attribute("points") or "").split()
            assert len(points) == len(history)
            drawn = [json.loads(c.get_attribute("data-epsilon") or "") for c in page.locator("circle.point-spent").all()]
            assert drawn == [entry["epsilon_spent"] for entry in history]
            committed = [json.loads(c.get_attribute("data-epsilon") or "") for c in page.locator("circle.point-committed").all()]
            assert committed[-1] == pytest.approx(expected[ids[1]]["epsilon_committed"], rel=1e-12) and committed[-1] < drawn[-1]
            assert page.locator("tr[data-charge-id]").count() == 5
            reserves = [entry for entry in history if entry["event"] == "reserve"]
            for entry in reserves:  # time, σ, q (the service's B / n) and steps of every charge, as the API has them
                row = page.locator(f'tr[data-charge-id="{entry["charge_id"]}"]')
                created = row.locator("td[data-created-at]").get_attribute("data-created-at")
                assert created == entry["created_at"].replace("Z", "+00:00")
                assert row.locator("td[data-sigma]").inner_text() == "1"
                q = json.loads(row.locator("td[data-q]").get_attribute("data-q") or "")
                assert q == entry["mechanism"]["sampling_rate"] == 20 / 2000
                assert row.locator("td[data-steps]").inner_text() == "10"
            assert page.locator("#verification").get_attribute("data-ok") == "true"
            assert page.locator("#verification").inner_text().startswith(f"verified: {len(history)} entries")

            screenshot = shots / "silo.png"
            page.screenshot(path=str(screenshot), full_page=True)

            # An edited charge: the overview, the first page an auditor sees, says so.
            engine = create_engine(database_url)
            with engine.begin() as connection:
                connection.execute(text("UPDATE charges SET round = 99 WHERE id = :id"), {"id": reserves[0]["charge_id"]})
            engine.dispose()
            page.goto(f"{server}/dashboard")
            alert = page.locator("#chain-status")
            assert alert.get_attribute("data-ok") == "false" and alert.get_attribute("data-broken") == str(ids[1])
            assert alert.is_visible() and alert.inner_text().startswith("Verification FAILED for 1 silo: bank-b")
            assert page.locator(f'tr[data-silo-id="{ids[1]}"] td[data-chain]').inner_text() == "BROKEN"
            page.screenshot(path=str(shots / "overview-broken.png"), full_page=True)
            assert console_errors == []
        finally:
            browser.close()

    png = screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 20_000  # a blank 1280×900 page compresses to a few kB
