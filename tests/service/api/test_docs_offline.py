"""/docs and /redoc work without the internet: every script, stylesheet and icon they reference is
served by the app itself (fastapi-offline's copies of Swagger UI and ReDoc), none by a CDN."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from dpledger.service.api.app import DOCS_ASSETS, create_app
from dpledger.service.settings import Settings

REFERENCE = re.compile(r"""(?:src|href|url|spec-url)\s*[=:]\s*["']([^"']+)["']""")


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(Settings(database_url="sqlite://", admin_key=None)))


@pytest.mark.parametrize(("page", "assets"), [
    ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
    ("/redoc", {"redoc.standalone.js", "favicon.png"}),
])
def test_docs_pages_name_no_other_host_and_every_asset_is_served(client: TestClient, page: str, assets: set[str]) -> None:
    html = client.get(page)
    assert html.status_code == 200
    references = REFERENCE.findall(html.text)
    assert "/openapi.json" in references
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html.text, re.IGNORECASE), "a page names another host"
    assert {r.removeprefix(f"{DOCS_ASSETS}/") for r in references if r.startswith(DOCS_ASSETS)} == assets
    for asset in assets:
        response = client.get(f"{DOCS_ASSETS}/{asset}")
        assert response.status_code == 200 and len(response.content) > 1000, asset
    assert '"validatorUrl": null' in client.get("/docs").text  # no validity badge from validator.swagger.io
