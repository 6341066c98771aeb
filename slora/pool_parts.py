"""The owners of an engine's pool, built to its sizes: the runner (rank 0's, under tensor parallelism), the page
allocator, the adapter manager and the scheduler."""
from typing import NamedTuple

from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler
from slora.execution.adapter_manager import AdapterFormat, AdapterManager
from slora.execution.model_runner import ModelRunner
from slora.execution.parallel_runner import OtherRanks, ParallelRunner
from slora.execution.step_channel import StepChannel
from slora.sizing import EngineSizing


class PoolParts(NamedTuple):
    """The owners of the pool's pages, built to the sizes: KV pages go to the scheduler, adapter weights to
    the adapter manager, and the runner holds the pool itself."""

    runner: ModelRunner | ParallelRunner
    allocator: PageAllocator
    adapters: AdapterManager
    scheduler: Scheduler


def build_runner(sizing: EngineSizing, channel: StepChannel | None = None) -> ModelRunner:
    """The runner over a pool sized by `sizing`; under tensor parallelism (`channel`), the smallest of every
    rank's pool, so that all hold the same page ids."""
    config = sizing.config
    pool_shape, swap_pages = sizing.pool_shape(), sizing.swap_pages()
    if channel is not None:
        pool_shape = pool_shape.with_pages(channel.smallest(pool_shape.num_pages))
    graphs = sizing.graph_limits(pool_shape) if config.device != "cpu" and not config.cuda.enforce_eager else None
    return ModelRunner(sizing.model, pool_shape, config.torch_device, graphs, swap_pages, config.cuda.pdl)


def build_pool_parts(sizing: EngineSizing, others: OtherRanks | None = None) -> PoolParts:
    """The runner (under tensor parallelism rank 0's, telling the `others`), the page allocator and the two
    owners of its pages, sized by `sizing`."""
    config = sizing.config
    runner = build_runner(sizing, None if others is None else others.channel)
    pool_shape = runner.shape
    allocator = PageAllocator(pool_shape.num_pages, config.page_size)
    scheduler_config = config.scheduler_config(sizing.swap_pages(), sizing.max_model_len)
    adapter_format = AdapterFormat(sizing.shapes, config.max_lora_rank, pool_shape.page_elems, config.torch_dtype,
                                   pin_memory=config.device != "cpu", sharding=sizing.sharding)
    adapters = AdapterManager(allocator, adapter_format, config.adapter_host_cache_bytes,
                              scheduler_config.usable_pages(allocator.num_pages))
    scheduler = Scheduler(scheduler_config, allocator, adapter_pool=adapters)
    if others is None:
        return PoolParts(runner, allocator, adapters, scheduler)
    return PoolParts(ParallelRunner(runner, others), allocator, adapters, scheduler)
