"""/docs in a real headless Chromium: Swagger UI renders the API from assets the server itself
serves, and the page asks no other host for anything (it works where there is no internet)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dpledger.harness import running_server
from tests.conftest import ADMIN_KEY

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is absent (pip install playwright)")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    with running_server(database_url=f"sqlite:///{tmp_path}/l.db", admin_key=ADMIN_KEY) as url:
        yield url


def test_swagger_ui_renders_from_the_servers_own_assets_and_asks_no_other_host(server: str, tmp_path: Path) -> None:
    requested: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda request: requested.append(request.url))
            page.goto(f"{server}/docs")
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            assert page.locator(".swagger-ui .info .title").inner_text().startswith("dpledger")
            page.wait_for_selector("#operations-silos-create_silo", timeout=30_000)
            assert page.locator(".opblock").count() >= 20  # one block per operation of the API
            # DPLEDGER_SCREENSHOTS=folder keeps the screenshot for a person to look at.
            shots = Path(os.environ.get("DPLEDGER_SCREENSHOTS", tmp_path))
            page.screenshot(path=str(shots / "docs.png"), full_page=False)
        finally:
            browser.close()
    hosts = {urlsplit(url).netloc for url in requested if not url.startswith("data:")}
    assert hosts == {urlsplit(server).netloc}, requested
    assert f"{server}/openapi.json" in requested and f"{server}/docs-assets/swagger-ui-bundle.js" in requested
