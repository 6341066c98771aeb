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

--model runs the same measure on the engine with a real model (the default, SmolLM2-135M-Instruct, unless
named), on the GPU when there is one: instruction prompts through its chat template, each beam search capped at
an Alpaca-like output length and ended by the model's EOS as transformers would; after every schedule (the tables
the step's forward reads), the running beams of each request are counted as above. Prefix caching is off, so
only a group's own sharing counts.

    python benchmarks/beam_memory.py [--requests 500] [--widths 2,4,6] [--quick]
    python benchmarks/beam_memory.py --model [NAME] [--requests 200] [--widths 2,4,6]
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import after_each_schedule, default_out, print_table, write_json

from slora.config import EngineConfig
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler
from slora.core.sequence import Sequence
from slora.models.builtin import DEFAULT_MODEL
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


# Instructions for the real model: every template with every topic, in a seeded order.
TEMPLATES = ("Explain how {} works.", "Write a short poem about {}.", "Give three facts about {}.",
             "Describe {} to a child.", "What are the pros and cons of {}?", "Summarize the history of {}.",
             "Write a tweet about {}.", "List some uses of {}.")
TOPICS = ("bees", "the moon", "bread", "rain", "volcanoes", "chess", "bicycles", "coffee", "the internet",
          "glaciers", "jazz", "solar panels", "paper", "trains", "tea", "whales", "maps", "clocks", "soap",
          "gardens", "batteries", "bridges", "cheese", "kites", "rivers", "vaccines", "libraries", "salt",
          "owls", "music theory")


def instructions(count: int, rng: np.random.Generator) -> list[str]:
    pool = [template.format(topic) for template in TEMPLATES for topic in TOPICS]
    return [pool[i] for i in rng.permutation(len(pool))[:count]]


class GroupPages:
    """Counts, after each schedule (`after_each_schedule`: the tables the step's forward reads, as in the
    simulator), the running beams of every beam-search request: their distinct pages (as the pool holds them)
    and the sum of their block tables (as full copies)."""

    def __init__(self, llm: Any) -> None:
        self.shared = self.unshared = 0
        after_each_schedule(llm, self._count)

    def take(self) -> tuple[int, int]:
        """(shared, unshared) page-steps so far, the counts starting over."""
        counts, self.shared, self.unshared = (self.shared, self.unshared), 0, 0
        return counts

    def _count(self, engine: Any) -> None:
        groups: dict[str, list[list[int]]] = {}
        for seq in engine.scheduler.running:
            if seq.params.use_beam_search:
                groups.setdefault(seq.request_id, []).append(list(seq.block_table))
        for tables in groups.values():
            self.shared += len({page for table in tables for page in table})
            self.unshared += sum(len(table) for table in tables)


def run_model(model: str, device: str, requests: int, widths: list[int]) -> list[dict[str, Any]]:
    """The measure on the engine with a real model (see the module's doc)."""
    from slora import LLM

    # Synchronous steps: an overlapped schedule runs before the last step's selection has forked its beams.
    llm = LLM(model, device=device, page_size=PAGE_SIZE, enable_prefix_caching=False, max_beam_width=max(widths),
              async_scheduling=False)
    pages = GroupPages(llm)
    rows = []
    for width in widths:
        rng = np.random.default_rng(SEED)
        output_lens = [o for _, o in alpaca_like(requests, rng)]
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": text}]) for text in instructions(requests, rng)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, [SamplingParams(use_beam_search=True, beam_width=width, max_tokens=n)
                                         for n in output_lens])
        rows.append(_row(width, requests, *pages.take(), [len(p) for p in prompts],
                         [len(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start))
    llm.close()
    return rows


def _row(width: int, requests: int, shared: int, unshared: int, prompt_lens: list[int], output_lens: list[int],
         seconds: float) -> dict[str, Any]:
    log.info("width %d: %.1f%% saved", width, 100 * (1 - shared / unshared))
    return {"width": width, "requests": requests, "shared_page_steps": shared, "unshared_page_steps": unshared,
            "saving_pct": 100 * (1 - shared / unshared), "mean_prompt": float(np.mean(prompt_lens)),
            "mean_output": float(np.mean(output_lens)), "seconds": seconds}


def run(requests: int, widths: list[int], peak: float) -> list[dict[str, Any]]:
    rows = []
    for width in widths:
        rng = np.random.default_rng(SEED)
        lengths = alpaca_like(requests, rng)
        start = time.perf_counter()
        totals = [search(p, o, width, rng, peak) for p, o in lengths]
        shared, unshared = (sum(column) for column in zip(*totals, strict=True))
        rows.append(_row(width, requests, shared, unshared, [p for p, _ in lengths], [o for _, o in lengths],
                         time.perf_counter() - start))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--widths", default="2,4,6")
    parser.add_argument("--peak", type=float, default=2.0, help="scale of the synthetic logits")
    parser.add_argument("--model", nargs="?", const=DEFAULT_MODEL, default=None,
                        help=f"measure on the engine with this model (default {DEFAULT_MODEL})")
    parser.add_argument("--quick", action="store_true", help="20 requests, 3 with --model (the smoke tests)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    requests = (3 if args.model else 20) if args.quick else args.requests
    widths = [int(w) for w in args.widths.split(",")]
    device = "cuda" if args.model and torch.cuda.is_available() else "cpu"
    if args.model:
        rows = run_model(args.model, device, requests, widths)
        setup = {"model": args.model, "device": device}
    else:
        rows = run(requests, widths, args.peak)
        setup = {"vocab": VOCAB, "peak": args.peak}
    print_table(rows)
    name = "beam_memory_model" if args.model else "beam_memory"
    write_json(Path(args.out) if args.out else default_out(name, device),
               {"benchmark": name, "quick": args.quick, "page_size": PAGE_SIZE, "seed": SEED, **setup,
                "rows": rows})


if __name__ == "__main__":
    main()
