"""Turning a GGUF file into a Hugging Face folder that slora (and transformers) load, once per file.

transformers reads GGUF and dequantizes every tensor to float; `save_pretrained` then writes an ordinary
folder (config, safetensors, tokenizer, chat template), made once per file content in the slora cache
(`model_cache.build_once`: an interrupted conversion leaves no folder a later start would use).
"""
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from slora.models.cache import build_once

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# GGUF `general.architecture` values whose transformers conversion gives a model slora runs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_HASH_CHUNK_BYTES = 8 << 20


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and what to do."""


def converted_folder(gguf_path: Path, cache: Path, fix: str) -> Path:
    """The HF folder converted from `gguf_path` under `cache` (named by the file's content hash), converting
    it first if it is not there. `fix` tells the user how to get a good file, for the errors about this one."""
    gguf_path = _existing_file(gguf_path, fix)
    target = cache / f"{gguf_path.stem}-{_content_hash(gguf_path)[:16]}"
    return build_once(target, lambda staging: convert(gguf_path, staging, fix))


def gguf_architecture(gguf_path: Path, fix: str) -> str:
    """The file's `general.architecture`; ModelFileError if the file is not a readable GGUF."""
    from gguf import GGUFReader
    try:
        field = GGUFReader(str(gguf_path)).get_field("general.architecture")
    except (ValueError, OSError, IndexError, KeyError) as exc:   # what a truncated or foreign file raises
        raise ModelFileError(f"{gguf_path} is not a readable GGUF file ({exc}); {fix}") from None
    if field is None:
        raise ModelFileError(f"{gguf_path} has no general.architecture; {fix}")
    return str(field.contents())


def _existing_file(gguf_path: Path, fix: str) -> Path:
    if not gguf_path.is_file():
        raise ModelFileError(f"model file {gguf_path} not found; {fix}")
    return gguf_path.resolve()


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf_path: Path, folder: Path, fix: str) -> None:
    """Dequantize `gguf_path` into an HF folder (float32 safetensors, tokenizer, chat template)."""
    architecture = gguf_architecture(gguf_path, fix)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{gguf_path} holds a {architecture!r} model; slora serves GGUF models of "
                             f"the architectures {', '.join(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    logger.info("converting %s into %s (once; about a minute on 2 cores)", gguf_path, folder)
    source, name = str(gguf_path.parent), gguf_path.name
    with tqdm(total=3, desc=f"slora: converting {name}", unit="step") as progress:
        try:
            AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(str(folder))
            progress.update()
            model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
        except (ValueError, KeyError, TypeError) as exc:   # what transformers raises on a file it cannot map
            raise ModelFileError(f"transformers could not convert {gguf_path}: {exc}; {fix}") from None
        progress.update()
        _save_dequantized(model, folder)
        progress.update()


def _save_dequantized(model: "PreTrainedModel", folder: Path) -> None:
    """transformers refuses to save a model it loaded from GGUF although every weight is already float:
    drop the quantizer and its config so that it is saved as the plain model it is."""
    # torch types Module.__setattr__ for tensors and modules only; a plain attribute takes any value.
    model.hf_quantizer = None   # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(folder), safe_serialization=True)
