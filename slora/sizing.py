"""How big an engine's pool, swap space and decode graphs are, from its config and its model."""
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slora.adapters.shapes import TargetShapes
from slora.adapters.sharding import AdapterSharding
from slora.config import EngineConfig
from slora.core.step_stats import DecodeBytes
from slora.execution.cuda_graphs import GraphLimits
from slora.execution.model_runner import profile_activation_bytes
from slora.execution.pool_memory import PoolShape
from slora.kernels.checks import check_adapter_span
from slora.kernels.layout import align_up
from slora.models.config import load_model_config
from slora.models.registry import ServedModel, build_model
from slora.models.sharding import ROW_PARALLEL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSizing:
    """The sizes of an engine (of one tensor-parallel rank's part of it, under tensor parallelism). `shapes`:
    the whole model's adapter layout, which adapters are checked against; `sharding`: how each rank's part of
    an adapter is cut and laid out, under tensor parallelism."""
    config: EngineConfig
    model: ServedModel
    shapes: TargetShapes
    max_model_len: int
    sharding: AdapterSharding | None = None

    @classmethod
    def of(cls, config: EngineConfig, model: ServedModel, folder: Path) -> "EngineSizing":
        """The sizing of `model` (loaded from `folder`, whole or a rank's part) under `config`."""
        whole = load_model_config(folder)
        max_model_len = min(config.max_model_len or whole.max_model_len, whole.max_model_len)
        sharding = None
        if config.tensor_parallel_size > 1:
            sharding = AdapterSharding(config.tensor_parallel_size, config.fully_sharded_loras,
                                       frozenset(ROW_PARALLEL), model.lora_targets())
        return cls(config, model, build_model(whole, "meta").lora_targets(), max_model_len, sharding)

    @property
    def pool_shapes(self) -> TargetShapes:
        """The adapter layout of this rank's pool: its part of every adapter."""
        return self.shapes if self.sharding is None else self.sharding.shapes

    @property
    def template(self) -> PoolShape:
        """The pool's shape without its number of pages."""
        cfg, config = self.model.config, self.config
        return PoolShape(cfg.num_layers, 0, config.page_size, cfg.num_kv_heads, cfg.head_dim, config.torch_dtype,
                         config.torch_kv_cache_dtype, config.kv_cache_skip_layers)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer."""
        return self.template.bytes_per_page

    def pool_shape(self) -> PoolShape:
        """The pool's shape, sized as configured. An adapter of max_lora_rank must fit the kernels' index
        range: refused here, rather than by the LoRA kernels at the first step with adapters."""
        template = self.template
        check_adapter_span(self.max_adapter_pages(template), template.page_elems,
                           f"an adapter of max_lora_rank={self.config.max_lora_rank} (lower it)")
        return template.with_pages(self._num_pages(template))

    def swap_pages(self) -> int:
        if self.config.preemption_mode != "swap":
            return 0
        return int(self.config.swap_space_gib * 2 ** 30) // self.page_bytes

    def _num_pages(self, template: PoolShape) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        if self.config.device == "cpu":
            return max(1, int(self.config.pool_gib * 2 ** 30) // self.page_bytes)
        # After the weights: a profiling prefill at the largest step measures the activations; the
        # rest of `gpu_memory_utilization` of the whole GPU becomes pages.
        tokens = min(self.config.step_tokens, self.max_model_len)
        activations = profile_activation_bytes(self.model, template, tokens, self.config.torch_device)
        total = torch.cuda.get_device_properties(self.config.torch_device).total_memory
        budget = total * self.config.cuda.gpu_memory_utilization - held_bytes(self.config.torch_device) - activations
        pages = int(budget) // self.page_bytes
        if pages < 1:
            raise ValueError("no GPU memory is left for the pool: raise gpu_memory_utilization or use a "
                             "smaller model")
        logger.info("pool: %d pages of %d tokens (%.2f GiB); activations %.2f GiB", pages,
                    self.config.page_size, pages * self.page_bytes / 2 ** 30, activations / 2 ** 30)
        return pages

    def max_adapter_pages(self, shape: PoolShape) -> int:
        """Pool pages of the largest adapter this engine takes (max_lora_rank on every module)."""
        rank = self.config.max_lora_rank
        if self._lora_collectives:           # a fully sharded part's B keeps the rank padded to the ranks' multiple
            rank = -(-rank // self.config.tensor_parallel_size) * self.config.tensor_parallel_size
        shapes = self.pool_shapes
        elems = sum(rank * (align_up(i) + align_up(o)) for i, o in map(shapes.features, shapes.modules))
        return -(-elems // shape.page_elems)

    def graph_limits(self, shape: PoolShape) -> GraphLimits:
        """The decode-graph and warm-up limits of a CUDA engine with this config over this pool shape."""
        return GraphLimits(max_batch=self.config.max_num_seqs,
                           max_blocks=-(-self.max_model_len // self.config.page_size),
                           max_adapter_pages=self.max_adapter_pages(shape), max_lora_rank=self.config.max_lora_rank,
                           num_layers=self.shapes.num_layers, num_lora_modules=len(self.shapes.modules),
                           max_loras=self.config.max_loras, few_adapters=self.config.cuda.graph_few_adapters,
                           lora_side_stream=self.config.cuda.lora_side_stream and not self._lora_collectives,
                           mixed_tokens=min(self.config.cuda.mixed_graph_tokens, self.config.step_tokens))

    @property
    def _lora_collectives(self) -> bool:
        """Whether the LoRA sends messages of its own (fully sharded adapters): then it stays on the forward's
        stream, since collectives on two streams of one graph could run in other orders on other ranks."""
        return self.sharding is not None and self.sharding.fully_sharded

    def decode_bytes(self, adapter_weight_bytes: Callable[[str], int]) -> DecodeBytes:
        """What a decode step reads. A decode step reads only the batch's rows of the input embedding table,
        unless the table is tied to lm_head, which reads all of it."""
        embedding = self.model.input_embeddings().weight                         # [vocab, hidden]
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = self.model.lm_head.weight is embedding
        untied_table = 0 if tied else embedding.numel() * embedding.element_size()
        return DecodeBytes(params - untied_table, 0 if tied else embedding.shape[1] * embedding.element_size(),
                           self.page_bytes // self.config.page_size, adapter_weight_bytes)


def held_bytes(device: torch.device) -> int:
    """GPU memory held by this process and any other, less what torch's caching allocator has freed and keeps
    (the cache is emptied first; what stays is partly used segments). Loading leaves freed blocks behind (copies
    such as a model drawn in float32 then cast, the projections before fusing, the activations' profile), which
    `mem_get_info` counts as used: an 8B model on an H100 got a 38.75 GiB pool where vLLM had about 55 GiB."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    kept_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return total - free - kept_free
