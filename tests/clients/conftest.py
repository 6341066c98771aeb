"""Real clients against a real `slora serve` of the default model, one server for the folder.

The server helpers are tests/api/conftest.py's, loaded here as the module `api_server_helpers`: test folders have
no __init__.py, so a plain `import conftest` would find whichever conftest pytest loaded last."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from slora.models.builtin import DEFAULT_MODEL, resolve_model

if "api_server_helpers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("api_server_helpers",
                                                   Path(__file__).parents[1] / "api" / "conftest.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["api_server_helpers"] = _module
    _spec.loader.exec_module(_module)

from api_server_helpers import Server, start_server  # noqa: E402


@pytest.fixture(scope="package")
def server(shared_server) -> Server:
    """`slora serve` with no --model: the default model, as customers start it. The session's one such server,
    tests/api/test_smollm2_serving.py's too: each start loads the model again (about 10 s here), and no client
    test depends on another's state, or on a fresh server's."""
    return shared_server(start_server, model=None)


@pytest.fixture(scope="session")
def offline_env() -> dict[str, str]:
    """The environment of a client process: tokenizers and datasets never come from the network (huggingface_hub
    and datasets read these once, when imported, which is why the clients run in processes of their own)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def tokenizer_folder() -> Path:
    """The default model's HF folder (tokenizer.json, tokenizer_config.json): what the clients tokenize with."""
    return resolve_model(DEFAULT_MODEL).folder
