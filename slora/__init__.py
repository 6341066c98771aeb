"""slora: multi-tenant, multi-LoRA LLM serving over one unified paged memory pool."""
import sys
from pathlib import Path
from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def _leave_the_checkout_off_sys_path() -> None:
    """Run inside a checkout (`python -m slora.cli` in its root puts the root on sys.path), the kernels/
    folder, which installs as slora.kernels, would shadow Hugging Face's `kernels` package, which
    transformers (5.25 and later) imports. Nothing is ever imported from the root itself."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "kernels" / "reference.py").is_file():
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != root]


_leave_the_checkout_off_sys_path()


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import slora.kernels` does not pull in transformers.
    if name == "LLM":
        from slora.llm import LLM
        return LLM
    if name == "SamplingParams":
        from slora.sampling.params import SamplingParams
        return SamplingParams
    if name == "RequestOutput":
        from slora.core.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'slora' has no attribute {name!r}")
