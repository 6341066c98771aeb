"""Which model class serves which Hugging Face architecture, and what the engine needs of one."""
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn

from slora.adapters.shapes import TargetShapes
from slora.execution.attention_backend import AttentionBackend
from slora.execution.lora_backend import LoraStep
from slora.execution.step_batch import StepBatch
from slora.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from slora.models.llama import LlamaForCausalLM


class CausalLM(Protocol):
    """A decoder over the paged pool. It declares its LoRA layout: `lora_modules` (the adapter tables'
    module axis) and `lora_groups` (consecutive modules that read one input and share a LoRA call)."""

    config: ModelConfig
    lora_modules: tuple[str, ...]
    lora_groups: tuple[slice, ...]
    lm_head: nn.Linear

    def lora_targets(self) -> TargetShapes: ...

    def input_embeddings(self) -> nn.Embedding: ...

    def fuse_projections(self) -> None: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def __call__(self, batch: StepBatch[Tensor], pool: Tensor, attention: AttentionBackend,
                 lora: LoraStep | None = None) -> Tensor: ...


# Mistral and Qwen2 checkpoints are the Llama decoder with other options (sliding window, q/k/v bias),
# which ModelConfig carries.
MODEL_CLASSES: dict[str, Callable[[ModelConfig], CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES), "every parsed architecture has a class"


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> CausalLM:
    """An (unloaded) model of the class that serves `config.architecture`."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model class serves {config.architecture}")
    with torch.device(device or "cpu"):
        return cls(config)
