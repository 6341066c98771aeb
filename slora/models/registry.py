"""Which model class serves which Hugging Face architecture, and what the engine needs of one."""
from collections.abc import Callable
from typing import Protocol

import torch

from slora.execution.causal_lm import CausalLM
from slora.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from slora.models.llama import LlamaForCausalLM


class ServedModel(CausalLM, Protocol):
    """A CausalLM with the configuration it was built from (what the engine sizes its pool by)."""

    config: ModelConfig


# Mistral and Qwen2 checkpoints are the Llama decoder with other options (sliding window, q/k/v bias),
# which ModelConfig carries.
MODEL_CLASSES: dict[str, Callable[[ModelConfig], ServedModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "every parsed architecture has a class"


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> ServedModel:
    """An (unloaded) model of the class that serves `config.architecture`."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model class serves {config.architecture}")
    with torch.device(device or "cpu"):
        return cls(config)
