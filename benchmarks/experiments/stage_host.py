"""Host time of building a graphed step's inputs and staging them into a graph's static buffers.

step_host.py's `--host-only` pass runs no graph on the CPU, so its build_inputs phase is the only part of a
graph replay's input work it times. This script times the rest on any machine, over step_host.py's
scenario: a decode step of 64 sequences on 8 rank-16 adapters (Llama-3-8B's 32 layers and 7 projections),
and the same step with a 448-token chunk of a 1,920-token prompt beside it (a 512-token mixed-step bucket).
Per row, `--iterations` calls, the best of `--repeats` runs, in µs a call:
- build: `step_batch.build`, what `ModelRunner.inputs_for` runs (adapter tables from its cache);
- stage: the step written into a host twin of its graph's static inputs and sent (`StagedBatch.begin`,
  `copy_into`, `send`; for the chunk step `MixedGraphs.stage`, with its extra inputs). With `--device cpu`
  the "device" buffer is a host tensor, so `send` is a memcpy, not a copy launch; with `--device cuda` the
  twins are pinned and each send launches the copy and records its event (the GPU is otherwise idle).

    python benchmarks/experiments/stage_host.py [--quick] [--device cpu|cuda] [--iterations 20000] [--repeats 5]
                                                [--out FILE]
"""
import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, best_us_per_call, parse_call_timing, print_table, write_json  # noqa: E402

from slora.adapters.packing import AdapterDescriptor  # noqa: E402
from slora.core.scheduler import ScheduledSeq  # noqa: E402
from slora.core.sequence import AdapterRef, BlockTable, Sequence  # noqa: E402
from slora.execution import step_batch  # noqa: E402
from slora.execution.cuda_graphs import DecodeGraphs, GraphLimits  # noqa: E402
from slora.execution.mixed_graphs import BucketGraph, MixedGraphs  # noqa: E402
from slora.sampling.params import SamplingParams  # noqa: E402

PAGE_SIZE = 16
DECODES, ADAPTERS, ADAPTER_PAGES = 64, 8, 40          # 40 pages: a rank-16 adapter on all 7 projections
PROMPT_LEN, CHUNK = 1920, 448
LAYERS, MODULES = 32, 7
LIMITS = GraphLimits(max_batch=72, max_blocks=PROMPT_LEN // PAGE_SIZE + 1, max_adapter_pages=ADAPTER_PAGES,
                     max_lora_rank=16, num_layers=LAYERS, num_lora_modules=MODULES, max_loras=32,
                     lora_side_stream=False, mixed_tokens=512)


def decoding(seq_id: int) -> ScheduledSeq:
    """A decode row: a 100-600 token context over its own pages, on one of the adapters."""
    context = 100 + 8 * seq_id
    pages = range(seq_id * 64, seq_id * 64 + context // PAGE_SIZE + 1)
    seq = Sequence(seq_id, f"d{seq_id}", list(range(context)), SamplingParams(max_tokens=512),
                   block_table=BlockTable(list(pages)), adapter=AdapterRef(f"v{seq_id % ADAPTERS}", ADAPTER_PAGES))
    seq.num_computed_tokens = context - 1
    return ScheduledSeq(seq, 1)


def chunk() -> ScheduledSeq:
    """The third 448-token chunk of a 1,920-token prompt, its whole table allocated."""
    seq = Sequence(999, "chunk", list(range(PROMPT_LEN)), SamplingParams(max_tokens=16),
                   block_table=BlockTable(list(range(5000, 5000 + PROMPT_LEN // PAGE_SIZE))),
                   adapter=AdapterRef("v0", ADAPTER_PAGES))
    seq.num_computed_tokens = 2 * CHUNK
    return ScheduledSeq(seq, CHUNK)


def step_adapters() -> step_batch.StepAdapters:
    ones = torch.ones(LAYERS, MODULES, dtype=torch.int32)
    return {f"v{i}": (AdapterDescriptor(ones * 16, ones.long() * i, ones.long() * i, ones.float()),
                      list(range(i * ADAPTER_PAGES, (i + 1) * ADAPTER_PAGES))) for i in range(ADAPTERS)}


def cases(device: torch.device) -> dict[str, Callable[[], object]]:
    """Per row, the call timed, with the static buffers on `device`. Only calls that older trees have too
    (gpu_check's stage_host_before runs this script over an older tree's package): the decode step is staged as
    DecodeGraphs.replay stages it, and the bucket's views are made as MixedGraphs._capture makes them."""
    adapters, tables = step_adapters(), step_batch.LoraTables()
    decode_rows = [decoding(i) for i in range(DECODES)]
    chunk_rows = [*decode_rows, chunk()]
    decode_host = step_batch.build(decode_rows, adapters, PAGE_SIZE, tables)
    chunk_host = step_batch.build(chunk_rows, adapters, PAGE_SIZE, tables)
    pool = torch.zeros(1, device=device)          # where the graphs' static buffers go
    decode_graphs = DecodeGraphs(torch.nn.Module(), pool, None, None, PAGE_SIZE, LIMITS)
    views = decode_graphs.batch(DECODES, with_lora=True)
    mixed = MixedGraphs(torch.nn.Module(), pool, None, None, PAGE_SIZE, LIMITS)
    bucket = mixed.bucket_for(DECODES + CHUNK, with_lora=True)
    assert bucket == 512 and mixed.fits(chunk_host, len(chunk_rows)) == bucket, "the chunk step needs its bucket"
    captured = BucketGraph(None, mixed.staged.views(mixed._sizes(bucket), with_lora=True), torch.zeros(0))

    def stage_decode() -> None:
        decode_host.copy_into(decode_graphs.staged.begin(views).batch)
        decode_graphs.staged.send()
    return {"decode step: build": lambda: step_batch.build(decode_rows, adapters, PAGE_SIZE, tables),
            "decode step: stage": stage_decode,
            "chunk step: build": lambda: step_batch.build(chunk_rows, adapters, PAGE_SIZE, tables),
            "chunk step: stage": lambda: mixed.stage(captured, chunk_host, None)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the static buffers are")
    parser.add_argument("--out", default=None, help="JSON file (default: results/stage_host.json)")
    args, timing = parse_call_timing(parser, argv, iterations=20000, quick_iterations=20)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here")
    rows = [{"call": name, "us_per_call": best_us_per_call(lambda call=call: call, timing)}
            for name, call in cases(torch.device(args.device)).items()]
    print_table(rows)
    write_json(Path(args.out or RESULTS / "stage_host.json"),
               {"benchmark": "stage_host", "device": args.device, "decodes": DECODES, "adapters": ADAPTERS,
                "chunk_tokens": CHUNK, "prompt_len": PROMPT_LEN, **timing._asdict(), "rows": rows})


if __name__ == "__main__":
    main()
