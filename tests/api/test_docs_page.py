"""/docs served whole by the server: Swagger UI's script, style and icon too, so that the page works on a
machine without internet access."""
import re
from urllib.parse import urljoin

import httpx
import pytest
from conftest import assert_error_shape, start_server

URL = re.compile(r"""https?://[^\s"'<>)]+""")
ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


@pytest.fixture(scope="module")
def server(shared_server, adapter_root):
    """test_adapters_api.py's server: nothing here depends on a fresh one."""
    return shared_server(start_server, "--adapter-root", str(adapter_root))


def test_docs_page_names_no_url_outside_the_server(server):
    page = httpx.get(f"{server.url}/docs", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    outside = [url for url in URL.findall(page.text) if not url.startswith(server.url)]
    assert not outside, outside
    assets = ASSET.findall(page.text)
    assert {asset.rsplit("/", 1)[-1] for asset in assets} >= {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}
    assert "/openapi.json" in page.text


def test_docs_assets_are_served_by_the_server(server):
    page = httpx.get(f"{server.url}/docs", timeout=60).text
    kinds = {"swagger-ui-bundle.js": "javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}
    for asset in ASSET.findall(page):
        response = httpx.get(urljoin(f"{server.url}/docs", asset), timeout=60)
        assert response.status_code == 200, (asset, response.status_code)
        assert kinds[asset.rsplit("/", 1)[-1]] in response.headers["content-type"], asset
        assert len(response.content) > 1000, asset           # the real file, not an empty or error body
    assert "SwaggerUIBundle" in httpx.get(f"{server.url}/docs/assets/swagger-ui-bundle.js", timeout=60).text
    assert httpx.head(f"{server.url}/docs", timeout=60).status_code == 200


def test_docs_assets_refuse_other_methods_and_unknown_files(server):
    wrong = httpx.post(f"{server.url}/docs/assets/swagger-ui.css", timeout=60)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, HEAD"
    assert_error_shape(wrong.json(), 405)
    missing = httpx.get(f"{server.url}/docs/assets/no-such-file.js", timeout=60)
    assert missing.status_code == 404
    assert_error_shape(missing.json(), 404)
