"""Paths no route serves: an OpenAI error object naming the path (404), whatever the path, OpenAI routes
this server does not implement included; a path served with other methods keeps its 405 and Allow header."""
import httpx
import pytest
from conftest import assert_error_shape, start_server


@pytest.fixture(scope="module")
def server(shared_server, adapter_root):
    """test_adapters_api.py's server: nothing here depends on a fresh one."""
    return shared_server(start_server, "--adapter-root", str(adapter_root))


@pytest.mark.parametrize("method, path", [("POST", "/v1/embeddings"), ("POST", "/v1/responses"),
                                          ("GET", "/v1/responses"), ("POST", "/v1/audio/speech"),
                                          ("GET", "/no/such/route")])
def test_unknown_routes_answer_an_error_object_naming_the_path(server, method, path):
    before = server.metrics().get('slora_http_errors_total{status="404"}', 0)
    response = httpx.request(method, f"{server.url}{path}", json={"model": "x", "input": "hi"}, timeout=60)
    assert response.status_code == 404, response.text
    body = response.json()
    assert_error_shape(body, 404)
    assert body["error"]["code"] == "route_not_found" and body["error"]["type"] == "not_found_error"
    assert f"{method} {path} is not served by this server" in body["error"]["message"]
    assert server.metrics()['slora_http_errors_total{status="404"}'] == before + 1


def test_a_long_unknown_path_is_cut_in_the_message(server):
    response = httpx.get(f"{server.url}/v1/{'x' * 5000}", timeout=60)
    assert response.status_code == 404
    assert len(response.json()["error"]["message"]) < 400


def test_a_known_path_with_another_method_is_still_a_405_with_allow(server):
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("DELETE", "/v1/models", "GET"),
                                  ("PUT", "/v1/adapters", "GET, POST")):
        response = httpx.request(method, f"{server.url}{path}", timeout=60)
        assert response.status_code == 405, (method, path, response.text)
        assert response.headers["allow"] == allowed, (method, path)
        assert_error_shape(response.json(), 405)
