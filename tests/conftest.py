"""Shared test setup. Triton kernels run in the interpreter when there is no GPU; the variable must be
set before triton is first imported, which is why it happens here, in the root conftest."""
import os
from pathlib import Path

import torch

import slora  # noqa: F401 - first: it takes the repository root off sys.path (slora/__init__.py says why)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402


def _patch_triton_language_once_per_launch() -> None:
    """The Triton interpreter patches triton.language for each kernel launch (restoring it after), and then
    again at every call of a @triton.jit device function inside the launch (tl.zeros is one too), although
    the patches of the launch and of the device calls before already cover the same modules: nothing is
    restored before the launch ends, the interpreter's own patch passes over members patched already and
    sets the rest to the same replacements again. Here a device call whose modules were patched so far in its
    launch skips that repeat (a good part of an interpreted kernel's time); any other call patches as the
    interpreter does."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return                                   # another Triton: its interpreter as it is
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    local = threading.local()                    # per thread: the modules patched so far in its running launch
    modules: dict = {}                           # function -> the modules of triton.language it sees

    def modules_of(fn) -> frozenset[int]:
        if fn not in modules:
            modules[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                    if inspect.ismodule(v) and v in (tl, tl.core))
        return modules[fn]

    def launch_patching_once(self, *args, **kwargs):
        stack = local.__dict__.setdefault("stack", [])
        stack.append(frozenset())                # nothing patched yet: the launch's own patch is to come
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def patch_once(fn):
        stack = local.__dict__.get("stack")
        if not stack:
            return patch_lang(fn)
        if stack[-1] and modules_of(fn) <= stack[-1]:    # a device call: its modules are patched
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)                   # the launch's own patch, or a device call's of new modules
        stack[-1] |= modules_of(fn)
        return scope

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_once, launch_patching_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()


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


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """`shared_server(start, *args, **kwargs)`: the session's one `start(log folder, *args, **kwargs)` (tests/api/
    conftest.py's start_server) for these arguments, started at its first use, for the test modules that serve
    with the same arguments and depend on no fresh server's state (counters, pool, adapters loaded): each start
    loads the model again, about 10 s here. All are stopped at the end of the session, and must exit 0."""
    servers: dict[tuple, object] = {}

    def get(start, *args: str, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in servers:
            servers[key] = start(tmp_path_factory.mktemp("shared-server"), *args, **kwargs)
        return servers[key]

    yield get
    failed = [f"{key}: exit {code}\n{server.log()[-3000:]}" for key, server in servers.items()
              if (code := server.stop()) != 0]
    assert not failed, "\n".join(failed)
