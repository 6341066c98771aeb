"""cProfile of the host side of one eager mixed step (64 decoding + 2 prefills, one adapter per sequence) of
the Llama-3-8B-shaped model: where run() spends its Python time (decode.py --mixed showed the host, not the
GPU, bounds such steps)."""
import cProfile
import pstats
import sys

import torch

from decode import MIXED_PREFILLS, make_runner, mixed_step, place_adapters, time_steps
from slora.page_pool import PageAllocator


def main() -> None:
    batch = 64
    count = batch + len(MIXED_PREFILLS)
    runner, descriptor, adapter_pages = make_runner(batch, count)
    runner.graphs = None
    allocator = PageAllocator(runner.shape.num_pages, runner.shape.page_size)
    adapters = place_adapters(runner, allocator, count, adapter_pages)
    scheduled, step_adapters = mixed_step(runner, allocator, adapters, descriptor, batch, count)
    time_steps(runner, scheduled, step_adapters, 3)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        runner.run(scheduled, step_adapters)
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
