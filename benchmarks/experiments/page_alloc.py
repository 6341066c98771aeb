"""Host time of the page allocator's bulk calls: what a prefill chunk's pages cost the scheduler.

A chunk of 448 tokens takes 28 pages at page size 16 in one `allocate_kv_pages` call, and registers their
hashes once computed. Once the prefix cache fills the pool (every long-running server), the pages come from
evicting cached KV instead of from the free list, and decode rows that fill a page evict one each. Each row
times one kind of call over a pool made for it, `--iterations` calls, and keeps the best of `--repeats`
runs (microseconds per call). Any machine: the allocator is plain Python.

    python benchmarks/experiments/page_alloc.py [--quick] [--pages 28] [--iterations 5000] [--out FILE]
"""
import argparse
import hashlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, print_table, write_json  # noqa: E402

from slora.page_pool import PageAllocator  # noqa: E402

PAGE_SIZE = 16


def page_hash(page: int) -> bytes:
    return hashlib.sha256(page.to_bytes(8, "little")).digest()


def cached_pool(num_pages: int) -> PageAllocator:
    """A pool whose every page is cached KV (hashed, unreferenced): each allocation evicts."""
    allocator = PageAllocator(num_pages, PAGE_SIZE)
    pages = allocator.allocate_kv_pages(num_pages)
    allocator.register_hashes(pages, [page_hash(page) for page in pages])
    allocator.release_kv_pages(pages)
    return allocator


def per_call_us(make: Callable[[], Callable[[], object]], iterations: int, repeats: int) -> float:
    """The best of `repeats` runs of `iterations` calls, each run on a fresh pool from `make`, in µs a call."""
    best = float("inf")
    for _ in range(repeats):
        call = make()
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        best = min(best, (time.perf_counter() - start) / iterations)
    return best * 1e6


def cases(pages: int, iterations: int) -> dict[str, Callable[[], Callable[[], object]]]:
    """Per row, a maker of a fresh pool and the call timed on it."""
    total = pages * iterations

    def chunk_from_free() -> Callable[[], object]:
        allocator = PageAllocator(total, PAGE_SIZE)
        return lambda: allocator.allocate_kv_pages(pages)

    def chunk_evicting() -> Callable[[], object]:
        allocator = cached_pool(total)
        return lambda: allocator.allocate_kv_pages(pages)

    def page_evicting() -> Callable[[], object]:
        allocator = cached_pool(iterations)
        return lambda: allocator.allocate_kv_pages(1)

    def register_chunk() -> Callable[[], object]:
        allocator = PageAllocator(total, PAGE_SIZE)
        chunks = iter([(allocator.allocate_kv_pages(pages), [page_hash(p) for p in range(i, i + pages)])
                       for i in range(0, total, pages)])
        return lambda: allocator.register_hashes(*next(chunks))

    return {f"{pages} pages from the free list": chunk_from_free, f"{pages} pages evicting cached KV": chunk_evicting,
            "1 page evicting cached KV": page_evicting, f"register {pages} pages' hashes": register_chunk}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few calls (CI)")
    parser.add_argument("--pages", type=int, default=28, help="pages of a chunk (default 28: 448 tokens)")
    parser.add_argument("--iterations", type=int, default=None, help="calls per run (default 5000; quick 50)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per row (default 5; quick 1)")
    parser.add_argument("--out", default=None, help="JSON file (default: results/page_alloc.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    iterations = args.iterations or (50 if args.quick else 5000)
    repeats = args.repeats or (1 if args.quick else 5)
    if args.pages < 1 or iterations < 1 or repeats < 1:
        raise SystemExit("--pages, --iterations and --repeats must be >= 1")
    rows = [{"call": name, "us_per_call": per_call_us(make, iterations, repeats)}
            for name, make in cases(args.pages, iterations).items()]
    print_table(rows)
    write_json(Path(args.out or RESULTS / "page_alloc.json"),
               {"benchmark": "page_alloc", "pages": args.pages, "iterations": iterations, "repeats": repeats,
                "rows": rows})


if __name__ == "__main__":
    main()
