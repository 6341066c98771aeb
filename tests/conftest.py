"""Shared test setup. Triton kernels run in the interpreter when there is no GPU; the variable must be
set before triton is first imported, which is why it happens here, in the root conftest."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@dataclass
class TinySetup:
    model_dir: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinySetup:
    """A 2-layer random Llama with the four test adapters of tests/tiny.py (made once per session)."""
    from tiny import make_adapters, make_model

    root = tmp_path_factory.mktemp("tiny-llama")
    model_dir = make_model(root, "llama", seed=5)
    return TinySetup(model_dir, make_adapters(model_dir, root))


@pytest.fixture(scope="session")
def smollm2():
    """The default model, SmolLM2-135M-Instruct, as the offline API serves it (converted on first use)."""
    from slora import LLM
    return LLM()
