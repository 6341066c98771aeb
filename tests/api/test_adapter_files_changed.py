"""An adapter whose files change or vanish on disk while it is out of host memory: its requests get a 409
naming what happened (not a 503 that SDKs would retry for ever), and the server goes on serving."""
import shutil

import pytest
from conftest import BASE_MODEL, assert_error_shape, start_server


@pytest.fixture(scope="module")
def root(tmp_path_factory, adapter_root):
    folder = tmp_path_factory.mktemp("changing-root")
    for name in ("attn-r4", "mlp-r8"):
        shutil.copytree(adapter_root / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, root):
    # No host cache: a registered adapter that is not in the pool is read back from disk when used.
    srv = start_server(tmp_path_factory.mktemp("logs"), "--adapter-root", str(root), "--adapter-host-cache-gib", "0")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def completion(http, model: str):
    return http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2})


@pytest.mark.parametrize("change", ["replaced", "vanished"])
def test_changed_adapter_files_are_409_and_others_are_served(server, root, adapter_root, change):
    name = f"changing-{change}"
    shutil.copytree(root / "attn-r4", root / name)
    with server.http() as http:
        assert http.post("/v1/adapters", json={"name": name, "path": name}).status_code == 200
        if change == "replaced":             # other weights under the same folder: another version
            shutil.copy(adapter_root / "mlp-r8" / "adapter_model.safetensors", root / name)
            shutil.copy(adapter_root / "mlp-r8" / "adapter_config.json", root / name)
        else:
            shutil.rmtree(root / name)
        response = completion(http, name)
        assert response.status_code == 409, response.text
        assert_error_shape(response.json(), 409)
        assert response.json()["error"]["code"] == "adapter_unavailable"
        assert completion(http, BASE_MODEL).status_code == 200
        assert completion(http, "demo-r4-attn").status_code == 200
        assert http.get("/health").json() == {"status": "ok"}
    assert "Traceback" not in server.log()
