"""The KV memory that page sharing saves a beam search, in the simulator: the real scheduler, page allocator and
beam selection (slora.sampling.beam_search), with a synthetic model in place of logits.

Requests follow an Alpaca-like length distribution (log-normal prompts of median 16 tokens, outputs of median
48, as Alpaca's short instructions and answers: means about 19 and 58 tokens), each searched at widths 2, 4
and 6 to its output length, in pages of 16 tokens. The model: each beam's next-token logprobs are a
log-softmax of Gaussian logits (scale --peak) over a 256-token vocabulary, drawn afresh per beam and step
from a seeded generator. At every step, the pages the group's beams hold (`shared`: distinct pages, as the
pool holds them) are set against the pages they would hold as full copies (`unshared`: the sum of their block
tables); the saving is 1 - sum(shared) / sum(unshared) over all steps of all requests, the share of
page-time that sharing saves. Kwon et al. (vLLM) measured 37.6-55.2% for beam search on Alpaca.

    python benchmarks/beam_memory.py [--requests 500] [--widths 2,4,6] [--quick]
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import default_out, print_table, write_json

from slora.config import EngineConfig
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler
from slora.core.sequence import Sequence
from slora.sampling.beam_search import BeamGroup, BeamSettings, Proposal
from slora.sampling.params import SamplingParams
from slora.sampling.request_state import SequenceMaker

VOCAB, PAGE_SIZE, SEED = 256, 16, 0
log = logging.getLogger("benchmarks.beam_memory")


def alpaca_like(count: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(prompt, output) lengths: log-normal around Alpaca's medians, clipped to [4, 256] and [8, 256]."""
    prompts = np.clip(rng.lognormal(np.log(16), 0.55, count), 4, 256).astype(int)
    outputs = np.clip(rng.lognormal(np.log(48), 0.6, count), 8, 256).astype(int)
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


def proposal(rng: np.random.Generator, size: int, peak: float) -> Proposal:
    logits = rng.standard_normal(VOCAB) * peak
    logprobs = logits - np.logaddexp.reduce(logits)
    best = np.argsort(-logprobs)[:size]
    return Proposal(best.tolist(), logprobs[best].tolist())


def search(prompt_len: int, output_len: int, width: int, rng: np.random.Generator,
           peak: float) -> tuple[int, int]:
    """One request's beam search to its output length; (shared, unshared) page-steps."""
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=4096, max_num_seqs=64, watermark=0.0,
                          enable_prefix_caching=False)
    scheduler = Scheduler(config.scheduler_config(0, 4096), PageAllocator(4096, PAGE_SIZE))
    maker = SequenceMaker(scheduler, None)
    params = SamplingParams(use_beam_search=True, beam_width=width, max_tokens=output_len, ignore_eos=True)
    parent = maker.new("r", list(range(prompt_len)), params, None, b"")
    group = BeamGroup.start(BeamSettings(width=width, length_penalty=1.0, early_stopping=False,
                                         max_tokens=output_len, stop_token_ids=frozenset()), parent)
    scheduler.add(parent)
    shared = unshared = 0
    while not group.done:
        for item in scheduler.schedule().scheduled:
            scheduler.on_computed(item.seq, item.num_tokens)
        tables = [list(beam.seq.block_table) for beam in group.beams]
        shared += len({page for table in tables for page in table})
        unshared += sum(len(table) for table in tables)
        for beam in list(group.beams):
            group.offer(beam.seq, proposal(rng, group.settings.proposals_per_beam, peak))
        group.advance(maker.fork, lambda seq: _end(scheduler, seq))
    scheduler.check()
    return shared, unshared


def _end(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.finish(seq, "stop")


def run(requests: int, widths: list[int], peak: float) -> list[dict[str, Any]]:
    rows = []
    for width in widths:
        rng = np.random.default_rng(SEED)
        lengths = alpaca_like(requests, rng)
        start = time.perf_counter()
        totals = [search(p, o, width, rng, peak) for p, o in lengths]
        shared, unshared = (sum(column) for column in zip(*totals, strict=True))
        rows.append({"width": width, "requests": requests, "shared_page_steps": shared,
                     "unshared_page_steps": unshared, "saving_pct": 100 * (1 - shared / unshared),
                     "mean_prompt": float(np.mean([p for p, _ in lengths])),
                     "mean_output": float(np.mean([o for _, o in lengths])),
                     "seconds": time.perf_counter() - start})
        log.info("width %d: %.1f%% saved", width, rows[-1]["saving_pct"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--widths", default="2,4,6")
    parser.add_argument("--peak", type=float, default=2.0, help="scale of the synthetic logits")
    parser.add_argument("--quick", action="store_true", help="20 requests (the smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    requests = 20 if args.quick else args.requests
    rows = run(requests, [int(w) for w in args.widths.split(",")], args.peak)
    print_table(rows)
    write_json(Path(args.out) if args.out else default_out("beam_memory", "cpu"),
               {"benchmark": "beam_memory", "quick": args.quick, "page_size": PAGE_SIZE, "vocab": VOCAB,
                "peak": args.peak, "seed": SEED, "rows": rows})


if __name__ == "__main__":
    main()
