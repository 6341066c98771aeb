"""How big an engine's pool, swap space and decode graphs are, from its config and its model."""
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slora.adapters.shapes import TargetShapes
from slora.config import EngineConfig
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler
from slora.core.step_stats import DecodeBytes
from slora.execution.adapter_manager import AdapterFormat, AdapterManager
from slora.execution.cuda_graphs import GraphLimits
from slora.execution.model_runner import ModelRunner, PoolShape, profile_activation_bytes
from slora.kernels.checks import check_adapter_span
from slora.kernels.layout import align_up
from slora.models.registry import ServedModel

logger = logging.getLogger(__name__)


class PoolParts(NamedTuple):
    """The owners of the pool's pages, built to the sizes: KV pages go to the scheduler, adapter weights to
    the adapter manager, and the runner holds the pool itself."""

    runner: ModelRunner
    allocator: PageAllocator
    adapters: AdapterManager
    scheduler: Scheduler


@dataclass(frozen=True)
class EngineSizing:
    config: EngineConfig
    model: ServedModel
    shapes: TargetShapes
    max_model_len: int

    @property
    def page_bytes(self) -> int:
        cfg = self.model.config
        elem = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return cfg.num_layers * 2 * self.config.page_size * cfg.num_kv_heads * cfg.head_dim * elem

    def pool_shape(self) -> PoolShape:
        """The pool's shape, sized as configured. An adapter of max_lora_rank must fit the kernels' index
        range: refused here, rather than by the LoRA kernels at the first step with adapters."""
        cfg = self.model.config
        template = PoolShape(cfg.num_layers, 0, self.config.page_size, cfg.num_kv_heads, cfg.head_dim)
        check_adapter_span(self.max_adapter_pages(template), template.page_elems,
                           f"an adapter of max_lora_rank={self.config.max_lora_rank} (lower it)")
        return PoolShape(cfg.num_layers, self._num_pages(template), self.config.page_size, cfg.num_kv_heads,
                         cfg.head_dim)

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
        activations = profile_activation_bytes(self.model, template, tokens, self.config.torch_dtype,
                                               self.config.torch_device)
        free, total = torch.cuda.mem_get_info(self.config.torch_device)
        budget = total * self.config.cuda.gpu_memory_utilization - (total - free) - activations
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
        elems = sum(rank * (align_up(i) + align_up(o)) for i, o in map(self.shapes.features, self.shapes.modules))
        return -(-elems // shape.page_elems)

    def graph_limits(self, shape: PoolShape) -> GraphLimits:
        """The decode-graph and warm-up limits of a CUDA engine with this config over this pool shape."""
        return GraphLimits(max_batch=self.config.max_num_seqs,
                           max_blocks=-(-self.max_model_len // self.config.page_size),
                           max_adapter_pages=self.max_adapter_pages(shape), max_lora_rank=self.config.max_lora_rank,
                           num_layers=self.shapes.num_layers, num_lora_modules=len(self.shapes.modules),
                           max_loras=self.config.max_loras, few_adapters=self.config.cuda.graph_few_adapters,
                           lora_side_stream=self.config.cuda.lora_side_stream,
                           mixed_tokens=min(self.config.cuda.mixed_graph_tokens, self.config.step_tokens))

    def decode_bytes(self, adapter_weight_bytes: Callable[[str], int]) -> DecodeBytes:
        """What a decode step reads. A decode step reads only the batch's rows of the input embedding table,
        unless the table is tied to lm_head, which reads all of it."""
        embedding = self.model.input_embeddings().weight                         # [vocab, hidden]
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = self.model.lm_head.weight is embedding
        untied_table = 0 if tied else embedding.numel() * embedding.element_size()
        return DecodeBytes(params - untied_table, 0 if tied else embedding.shape[1] * embedding.element_size(),
                           self.page_bytes // self.config.page_size, adapter_weight_bytes)


def build_pool_parts(sizing: EngineSizing) -> PoolParts:
    """The runner, the page allocator and the two owners of its pages, sized by `sizing`."""
    config = sizing.config
    pool_shape, swap_pages = sizing.pool_shape(), sizing.swap_pages()
    graphs = sizing.graph_limits(pool_shape) if config.device != "cpu" and not config.cuda.enforce_eager else None
    runner = ModelRunner(sizing.model, pool_shape, config.torch_dtype, config.torch_device, graphs, swap_pages,
                         config.cuda.pdl)
    allocator = PageAllocator(pool_shape.num_pages, config.page_size)
    scheduler_config = config.scheduler_config(swap_pages, sizing.max_model_len)
    adapter_format = AdapterFormat(sizing.shapes, config.max_lora_rank, pool_shape.page_elems, config.torch_dtype,
                                   pin_memory=config.device != "cpu")
    adapters = AdapterManager(allocator, adapter_format, config.adapter_host_cache_bytes,
                              scheduler_config.usable_pages(allocator.num_pages))
    return PoolParts(runner, allocator, adapters, Scheduler(scheduler_config, allocator, adapter_pool=adapters))
