"""Tensor-parallel ranks as processes (DESIGN §10). The engine is rank 0; it starts ranks 1 to N - 1, one
process each (one GPU each on CUDA), which load their part of the model, build a pool of the same pages, and
run what rank 0 sends them (slora.execution.parallel_runner) until it stops them. NCCL carries the forward's
collectives on CUDA, gloo on the CPU; the commands always go over a gloo group.

A rank that ends stops the engine: rank 0 checks the processes before each step, and a collective with a rank
gone fails at once (TensorParallelError), so nothing waits for it. Rank 0's process ending closes the
connections the others wait on, and they exit.
"""
import logging
import multiprocessing
import os
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from slora.config import EngineConfig
from slora.execution.parallel_runner import OtherRanks, serve_steps
from slora.execution.step_channel import StepChannel
from slora.execution.tensor_parallel import TensorParallel, TensorParallelError
from slora.kv_scales import kv_cache_scales
from slora.models.builtin import resolve_model
from slora.models.loader import load_model
from slora.models.sharding import Shard
from slora.models.tokenizer import load_tokenizer
from slora.pool_parts import build_runner
from slora.sizing import EngineSizing

logger = logging.getLogger(__name__)
# How long a collective may wait for a rank that is alive but silent (loading its part of a large model, or
# capturing its graphs); a rank that ended fails the collective at once.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
JOIN_POLL_S = 0.05


class RankGroup(NamedTuple):
    """This process's place among the ranks, and the channel rank 0's commands go over."""
    tp: TensorParallel
    channel: StepChannel


def join_group(store: dist.Store, rank: int, config: EngineConfig) -> RankGroup:
    size = config.tensor_parallel_size
    on_cuda = config.device != "cpu"
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    commands = dist.new_group(backend="gloo") if on_cuda else None
    return RankGroup(TensorParallel(rank, size, config.fully_sharded_loras), StepChannel(commands))


class Workers:
    """Ranks 1 to N - 1 of an engine of `config.tensor_parallel_size` ranks, started; this process joins the
    group as rank 0 once every one has started (or raises TensorParallelError naming one that ended first)."""

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():          # the ranks' group is the process's default one: one at a time
            raise ValueError("this process already runs a tensor-parallel engine (or another torch.distributed "
                             "group): close() it before starting another")
        size = config.tensor_parallel_size
        self._store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                                    wait_for_workers=False)
        context = multiprocessing.get_context("spawn")      # CUDA cannot be forked
        self._processes = [context.Process(target=run_rank, args=(config, rank, self._store.port), daemon=True,
                                           name=f"slora-tp-rank-{rank}") for rank in range(1, size)]
        for process in self._processes:
            process.start()
        self._wait_for_ranks()
        self.group = join_group(self._store, 0, config)

    def _wait_for_ranks(self) -> None:
        """Until every rank has reached the group (each sets its key first): a rank that ends before would
        leave the group's start waiting for the whole timeout."""
        keys = [_joining_key(rank) for rank in range(1, len(self._processes) + 1)]
        while not self._store.check(keys):
            self.check_alive()
            time.sleep(JOIN_POLL_S)

    @property
    def others(self) -> OtherRanks:
        """The channel to the ranks and the check of their processes, for rank 0's runner."""
        return OtherRanks(self.group.channel, self.check_alive)

    def check_alive(self) -> None:
        """TensorParallelError naming the first rank whose process has ended."""
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {rank} ended (exit code {process.exitcode}); the "
                                          "engine cannot go on without it")

    def stop(self, timeout_s: float = 30.0) -> None:
        """After rank 0 told them to stop: wait for the ranks to end (kill those that do not), leave the group."""
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _joining_key(rank: int) -> str:
    return f"slora/joining/{rank}"


def run_rank(config: EngineConfig, rank: int, port: int) -> None:
    """A rank's process: join, load its part of the model, build its pool, serve rank 0's commands."""
    if config.device == "cpu":      # the ranks compute at once: each takes its share of the cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size))
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    store.set(_joining_key(rank), "1")
    group = join_group(store, rank, config)
    source = resolve_model(config.model)
    model = load_model(source.folder, config.torch_dtype, config.torch_device, config.load_format,
                       Shard(rank, config.tensor_parallel_size))
    model.tensor_parallel = group.tp
    sizing = EngineSizing.of(config, model, source.folder)
    try:
        runner = build_runner(sizing, group.channel)
        if runner.shape.quantized:            # its heads' scales, found as rank 0 finds its own (kv_cache_scales)
            runner.set_kv_scales(kv_cache_scales(config.kv_cache_scales, source.folder, model, runner.shape,
                                                 config.torch_device, load_tokenizer(source.folder),
                                                 model.config.vocab_size, Shard(rank, config.tensor_parallel_size)))
        serve_steps(runner, group.channel)
    except TensorParallelError:
        logger.error("tensor-parallel rank %d: rank 0 is gone; this rank ends", rank)
    finally:
        dist.destroy_process_group()
