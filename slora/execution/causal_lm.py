"""What the execution room needs of a model: a decoder over the paged pool with its LoRA layout."""
from collections.abc import Iterator
from typing import Protocol

from torch import Tensor, nn

from slora.adapters.shapes import TargetShapes
from slora.execution.attention_backend import AttentionBackend
from slora.execution.lora_backend import LoraStep
from slora.execution.pool_memory import PoolViews
from slora.execution.step_batch import StepBatch
from slora.execution.tensor_parallel import TensorParallel


class CausalLM(Protocol):
    """A decoder over the paged pool. It declares its LoRA layout: `lora_modules` (the adapter tables'
    module axis) and `lora_groups` (consecutive modules that read one input and share a LoRA call)."""

    lora_modules: tuple[str, ...]
    lora_groups: tuple[slice, ...]
    lm_head: nn.Linear
    tensor_parallel: TensorParallel | None      # this rank's place, when the model is split over several

    def lora_targets(self) -> TargetShapes: ...

    def input_embeddings(self) -> nn.Embedding: ...

    def fuse_projections(self) -> None: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def __call__(self, batch: StepBatch[Tensor], pool: PoolViews, attention: AttentionBackend,
                 lora: LoraStep | None = None) -> Tensor: ...
