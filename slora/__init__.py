"""slora: multi-tenant, multi-LoRA LLM serving over one unified paged memory pool."""
from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import slora.kernels` does not pull in transformers.
    if name == "LLM":
        from slora.llm import LLM
        return LLM
    if name == "SamplingParams":
        from slora.sampling_params import SamplingParams
        return SamplingParams
    if name == "RequestOutput":
        from slora.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'slora' has no attribute {name!r}")
