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
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, best_us_per_call, parse_call_timing, print_table, write_json  # noqa: E402

from slora.core.page_pool import PageAllocator  # noqa: E402

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
    parser.add_argument("--pages", type=int, default=28, help="pages of a chunk (default 28: 448 tokens)")
    parser.add_argument("--out", default=None, help="JSON file (default: results/page_alloc.json)")
    args, timing = parse_call_timing(parser, argv, iterations=5000, quick_iterations=50)
    if args.pages < 1:
        raise SystemExit("--pages must be >= 1")
    rows = [{"call": name, "us_per_call": best_us_per_call(make, timing)}
            for name, make in cases(args.pages, timing.iterations).items()]
    print_table(rows)
    write_json(Path(args.out or RESULTS / "page_alloc.json"),
               {"benchmark": "page_alloc", "pages": args.pages, **timing._asdict(), "rows": rows})


if __name__ == "__main__":
    main()
