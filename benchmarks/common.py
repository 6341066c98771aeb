"""What the benchmark scripts share: output (machine, JSON, tables, plots), the Llama-3-8B shape and random
PEFT adapters, the model set-up of the end-to-end runs, host-side calls timed in a loop, the Llama-3-8B
layer's LoRA on the GPU, and the occupancy arithmetic of compiled kernels. What two scripts need lives here
(step_host.py alone takes engine_throughput.py's per-kind step timing).

torch, triton and safetensors are imported inside the functions that use them, so that the simulator
scripts (simulate.py, ablation.py), which share this module, stay torch-free.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from workloads import Request

RESULTS = Path(__file__).resolve().parent / "results"
# The H200's measured device-to-device copy rate, the roofline's bandwidth.
COPY_BANDWIDTH = 4.24e12
log = logging.getLogger("benchmarks")


# ---- output -------------------------------------------------------------------------------------------------
def bandwidth_columns(bytes_read: float, seconds: float, prefix: str) -> dict[str, float | None]:
    """`{prefix}_tb_s` (bytes read / time) and `{prefix}_pct_copy_bw` (of COPY_BANDWIDTH); None without time."""
    if seconds <= 0:
        return {f"{prefix}_tb_s": None, f"{prefix}_pct_copy_bw": None}
    bandwidth = bytes_read / seconds
    return {f"{prefix}_tb_s": bandwidth / 1e12, f"{prefix}_pct_copy_bw": 100 * bandwidth / COPY_BANDWIDTH}


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def machine_kind(device: str = "cuda") -> str:
    """The results folder of a run on `device`: cpu, h100, h200, or the GPU's name in lower case."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for kind in ("h100", "h200"):
        if kind in name:
            return kind
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu"


def default_out(script: str, device: str = "cuda", suffix: str = ".json") -> Path:
    """results/<machine kind>/<script><suffix>: the latest run of a script on one kind of machine, which the next
    run on that kind overwrites."""
    return RESULTS / machine_kind(device) / f"{script}{suffix}"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    log.info("wrote %s", path)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A bare JSON list of rows (simulate.py's and ablation.py's format), without write_json's envelope."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")
    log.info("wrote %s", path)


def print_table(rows: list[dict[str, Any]]) -> None:
    """One right-aligned table; floats get 3 decimals below 10 and 1 above, None prints as "-"."""
    if not rows:
        return
    widths = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in rows[0]}
    header = "  ".join(k.rjust(w) for k, w in widths.items())
    body = ["  ".join(_fmt(r[k]).rjust(w) for k, w in widths.items()) for r in rows]
    print("\n".join([header, "-" * len(header), *body]))  # noqa: T201 - the table is the script's output


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend, or None (with a warning) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[dev]'): no plot")
        return None
    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt
    plt.close(fig)
    log.info("wrote %s", path)


# ---- the Llama-3-8B shape and random PEFT adapters ------------------------------------------------------------
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "tie_word_embeddings": False, "hidden_act": "silu",
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP              # the seven LoRA-targetable projections of a Llama layer
# (name, in_features, out_features) of the seven projections of one Llama-3-8B layer.
LLAMA3_8B_MODULES = (("q_proj", 4096, 4096), ("k_proj", 4096, 1024), ("v_proj", 4096, 1024),
                     ("o_proj", 4096, 4096), ("gate_proj", 4096, 14336), ("up_proj", 4096, 14336),
                     ("down_proj", 14336, 4096))
# A 16-token page of Llama-3-8B's KV (K and V of 8 KV heads of 128), in elements: the pool's page width.
PAGE_ELEMS = 2 * 16 * 8 * 128


def write_config(folder: Path, raw: dict = LLAMA3_8B) -> Path:
    """A model folder holding only config.json (served with random weights: load_format="dummy")."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def projection_features(raw: dict = LLAMA3_8B) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each of the seven projections of a layer of this config."""
    from slora.models.config import parse_model_config

    cfg = parse_model_config(raw)
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_peft_adapter(folder: Path, raw: dict, rank: int, targets: tuple[str, ...], seed: int,
                       dtype: torch.dtype, scale: float = 0.05) -> Path:
    """A PEFT LoRA folder written directly (no peft call): random A and B (normal times `scale`, seeded)
    with PEFT's tensor names, for `targets` of every layer."""
    import torch
    from safetensors.torch import save_file

    features = projection_features(raw)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(raw["num_hidden_layers"]):
        for module in targets:
            block = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_f, out_f = features[module]
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=generator) * scale).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=generator) * scale).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


# ---- the model of the end-to-end runs (engine_throughput.py, serving.py, step_host.py) ----------------------
SLORA_LENGTHS = (8, 512)       # S-LoRA's input and output length range
LOAD_THREADS = 8               # threads that write adapter files, and that prepare them for slora


@dataclass(frozen=True)
class ModelSetup:
    """The base model both systems serve: slora-tiny-llama (CPU) or a Llama-3-8B-shaped dummy (GPU)."""

    folder: Path
    raw: dict[str, Any]                     # config.json
    device: str
    dtype: torch.dtype
    dummy: bool                             # random weights from config.json (load_format="dummy")
    description: str

    @property
    def vocab_size(self) -> int:
        return int(self.raw["vocab_size"])

    @property
    def context(self) -> int:
        """The tokens a sequence may hold, prompt and output (config.json's max_position_embeddings)."""
        return int(self.raw["max_position_embeddings"])


def prepare_model(device: str, workdir: Path) -> ModelSetup:
    import torch

    if device == "cpu":
        from slora.models.tiny import ensure_tiny_model
        folder = ensure_tiny_model().model_dir
        raw = json.loads((folder / "config.json").read_text())
        return ModelSetup(folder, raw, device, torch.float32, False,
                          "slora-tiny-llama (4 layers, hidden 128, 4 heads / 2 kv heads, vocab 512), float32")
    folder = write_config(workdir / "llama3-8b-shaped")
    return ModelSetup(folder, dict(LLAMA3_8B), device, torch.bfloat16, True,
                      "Llama-3-8B-shaped, random bfloat16 weights (load_format=dummy)")


def adapter_name(index: int) -> str:
    return f"a{index}"


def write_adapters(root: Path, setup: ModelSetup, ranks: list[int], targets: tuple[str, ...],
                   seed: int = 42) -> list[Path]:
    """One folder per adapter (root/a{i}); adapter i is seeded with seed + i."""
    start = time.perf_counter()
    # Threads: random generation and safetensors writes release the GIL (2,000 8B-shaped adapters are 27 GB).
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        paths = list(pool.map(lambda item: write_peft_adapter(root / adapter_name(item[0]), setup.raw, item[1],
                                                              targets, seed + item[0], setup.dtype),
                              enumerate(ranks)))
    log.info("wrote %d adapters in %.1f s", len(paths), time.perf_counter() - start)
    return paths


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as JSON where it parses (true, 8192, 0.5) and as a string otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_engine_arg(parser: argparse.ArgumentParser, example: str) -> None:
    """The repeatable `--engine-arg KEY=VALUE` option: an EngineConfig or CudaConfig field for the engine."""
    parser.add_argument("--engine-arg", type=parse_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                        help=f"an EngineConfig or CudaConfig field for the engine, e.g. {example} (repeatable)")


def make_prompts(trace: list[Request], vocab_size: int, seed: int) -> list[list[int]]:
    """Random prompt token ids, one list per request of the trace, of its prompt length."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    high = min(vocab_size, 128000) - 1
    return [torch.randint(3, high, (r.prompt_len,), generator=generator).tolist() for r in trace]


def after_each_step(llm: Any, note: Callable[[Any], None]) -> None:
    """Wrap an slora LLM's engine step: after each, `note(engine)` reads what it needs (the running sequences,
    pool_stats), so a script watches peaks without a hook in the engine."""
    _note_after(llm.engine, "step", llm.engine, note)


def after_each_schedule(llm: Any, note: Callable[[Any], None]) -> None:
    """Wrap an slora LLM's scheduler: after each schedule, `note(engine)` reads what the step's forward will
    read (block tables once forks have copied their shared partial pages, the KV pages held at the step's peak).
    After a step, the last selection's forks would still share pages that the next schedule copies."""
    _note_after(llm.engine.scheduler, "schedule", llm.engine, note)


def _note_after(owner: Any, method: str, engine: Any, note: Callable[[Any], None]) -> None:
    """Replace `owner.method` (no arguments) by one that calls it, then `note(engine)`."""
    call = getattr(owner, method)

    def watched() -> Any:
        result = call()
        note(engine)
        return result
    setattr(owner, method, watched)


# ---- host-side calls timed in a loop (step_host.py --host-speed) -----------------------------------------------
class CallTiming(NamedTuple):
    """How a host-side unit is timed: `iterations` calls a run, the best of `repeats` runs."""
    iterations: int
    repeats: int


def best_us_per_call(make: Callable[[], Callable[[], object]], timing: CallTiming) -> float:
    """The best of `timing.repeats` runs of `timing.iterations` calls, each run of a call from `make` (made fresh
    per run, untimed), in µs a call."""
    best = float("inf")
    for _ in range(timing.repeats):
        call = make()
        start = time.perf_counter()
        for _ in range(timing.iterations):
            call()
        best = min(best, (time.perf_counter() - start) / timing.iterations)
    return best * 1e6


# ---- the Llama-3-8B layer's LoRA on the GPU (kernel_bench.py) -------------------------------------------------
# The engine's LoRA calls per layer: modules that read the same input share one launch pair.
LORA_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def time_us(fn: Callable[[], object]) -> float:
    """Median eager time of `fn` in µs (triton.testing.do_bench)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_time_us(fn: Callable[[], object]) -> float | None:
    """Median time of `fn` replayed from a CUDA graph in µs; None (logged) when it cannot be captured."""
    import triton.testing
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    except RuntimeError as err:
        log.warning("CUDA graph capture failed: %s", err)
        return None


@dataclass
class LoraLayer:
    pool: Tensor
    page_tables: Tensor                      # [slots, pages per adapter]
    ranks: Tensor                            # [slots]
    offsets: dict[str, tuple[Tensor, Tensor]]   # module -> (a_offsets, b_offsets) [slots]
    scalings: Tensor                         # [slots]
    dense: list[dict[str, tuple[Tensor, Tensor]]]   # per adapter, module -> (A [r, in], Bᵀ [r, out])


def pack_lora_layer(num_adapters: int, rank: int, page_elems: int, dtype: torch.dtype,
                    gen: torch.Generator) -> LoraLayer:
    """One Llama-3-8B layer of `num_adapters` random rank-`rank` adapters packed into a pool, pages permuted."""
    import math

    import torch

    from slora.kernels.layout import align_up

    layout, cursor = {}, 0
    for name, fin, fout in LLAMA3_8B_MODULES:
        layout[name] = (cursor, cursor + rank * align_up(fin))
        cursor += rank * (align_up(fin) + align_up(fout))
    pages_each = math.ceil(cursor / page_elems)
    num_pages = 2 * num_adapters * pages_each + 1      # half unused, so adapters' pages are scattered
    pool = torch.randn(num_pages, page_elems, dtype=dtype, device="cuda")
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1)[:num_adapters * pages_each]
    tables = perm.view(num_adapters, pages_each).to(torch.int32).cuda()
    dense = []
    for a in range(num_adapters):
        buffer = torch.zeros(pages_each * page_elems, dtype=dtype, device="cuda")
        mats = {}
        for name, fin, fout in LLAMA3_8B_MODULES:
            a_off, b_off = layout[name]
            lora_a = torch.randn(rank, fin, device="cuda", dtype=dtype) / fin ** 0.5
            lora_bt = torch.randn(rank, fout, device="cuda", dtype=dtype) / rank ** 0.5
            buffer[a_off:a_off + rank * align_up(fin)].view(rank, align_up(fin))[:, :fin] = lora_a
            buffer[b_off:b_off + rank * align_up(fout)].view(rank, align_up(fout))[:, :fout] = lora_bt
            mats[name] = (lora_a, lora_bt)
        pool[tables[a].long()] = buffer.view(pages_each, page_elems)
        dense.append(mats)

    def full(value: int) -> Tensor:
        return torch.full((num_adapters,), value, dtype=torch.int64, device="cuda")

    offsets = {name: (full(a), full(b)) for name, (a, b) in layout.items()}
    return LoraLayer(pool, tables, full(rank).to(torch.int32), offsets,
                     torch.full((num_adapters,), 2.0, device="cuda"), dense)


@dataclass(frozen=True)
class LoraKnobs:
    """Launch choices of the layer's LoRA other than the wrappers' own (None: the wrapper's default)."""
    split_k: int | None = None
    accumulate: bool = True     # the engine's shrink (lora_shrink(out=h)) rather than split partial sums
    part: str = "both"          # time "both" kernels of each group, or only its "shrink" or its "expand"
    pdl: bool = False           # shrink and expand with programmatic dependent launch
    block_m: int | None = None  # tokens per LoRA block (16 or more: tl.dot's smallest M is 16)
    expand_gemv: bool = False   # the one-token expand kernel (lora_expand(gemv=True))
    group: int | None = None    # time only this group of LORA_GROUPS (q/k/v, o, gate/up, down)

    def __post_init__(self) -> None:
        if self.part not in ("both", "shrink", "expand"):
            raise ValueError(f"part must be both, shrink or expand, got {self.part!r}")

    def __str__(self) -> str:
        shrink = "into one h" if self.accumulate else "partials"
        return (f"shrink {shrink}, split_k {'auto' if self.split_k is None else self.split_k}, timed {self.part}"
                + (", programmatic dependent launch" if self.pdl else "")
                + (f", {self.block_m}-token blocks" if self.block_m else "")
                + (", one-token expand" if self.expand_gemv else "")
                + (f", group {'/'.join(LORA_GROUPS[self.group])} only" if self.group is not None else ""))


class LoraLayerStep(NamedTuple):
    """The layer's LoRA at one step, ready to launch: `run` launches what the knobs time."""
    layer: LoraLayer
    slots: Tensor                                        # [tokens]: each token's adapter slot
    inputs: dict[int, Tensor]                            # in_features -> x [tokens, in_features]
    num_slots: int                                       # adapter slots of the tables
    run: Callable[[], object]
    shrink: Callable[[Tensor, Tensor, Tensor], Tensor]   # (x, ranks, a_offsets) of one module -> its h


def lora_layer_step(num_adapters: int, tokens: int, rank: int, gen: torch.Generator,
                    knobs: LoraKnobs = LoraKnobs(), table_slots: int | None = None) -> LoraLayerStep:
    """The Llama-3-8B layer's LoRA (4 groups, shrink then expand each, as the engine launches them) for
    `tokens` tokens spread over `num_adapters` rank-`rank` adapters. table_slots: adapter slots in the
    tables (a decode graph has one per sequence however many are used; default num_adapters)."""
    import torch

    from slora.kernels.lora import lora_expand, lora_segments, lora_shrink

    dtype = torch.bfloat16
    num_slots = table_slots or num_adapters
    layer = pack_lora_layer(num_slots, rank, PAGE_ELEMS, dtype, gen)
    slots = (torch.randperm(tokens, generator=gen) % num_adapters).to(torch.int32).cuda()
    inputs = {fin: torch.randn(tokens, fin, device="cuda", dtype=dtype) for fin in (4096, 14336)}
    segments = lora_segments(slots, num_slots, knobs.block_m)   # once per step, shared by all modules and layers
    shapes = {name: (fin, fout) for name, fin, fout in LLAMA3_8B_MODULES}
    groups = []
    for names in LORA_GROUPS:
        sizes = [shapes[n][1] for n in names]
        groups.append((inputs[shapes[names[0]][0]], torch.randn(tokens, sum(sizes), device="cuda", dtype=dtype),
                       sizes, torch.stack([layer.ranks] * len(names)),
                       torch.stack([layer.offsets[n][0] for n in names]),
                       torch.stack([layer.offsets[n][1] for n in names]), torch.stack([layer.scalings] * len(names))))
    if knobs.group is not None:
        groups = [groups[knobs.group]]
    # As the engine does: one float32 workspace zeroed per step, a slice of it per shrink.
    workspace = torch.zeros(tokens * rank * len(LLAMA3_8B_MODULES), device="cuda")

    def shrink(x: Tensor, ranks: Tensor, a_offsets: Tensor, width: int, used: int) -> Tensor:
        if not knobs.accumulate:
            return lora_shrink(x, layer.pool, slots, layer.page_tables, ranks, a_offsets, rank, partials=True,
                               segments=segments, split_k=knobs.split_k, pdl=knobs.pdl)
        h = workspace[used:used + tokens * width].view(tokens, width)
        return lora_shrink(x, layer.pool, slots, layer.page_tables, ranks, a_offsets, rank, out=h,
                           segments=segments, split_k=knobs.split_k, pdl=knobs.pdl)

    def expand(h: Tensor, group: tuple) -> None:
        _, out, sizes, ranks, _, b_offsets, scalings = group
        lora_expand(out, h, layer.pool, slots, layer.page_tables, ranks, b_offsets, scalings, out_sizes=sizes,
                    segments=segments, pdl=knobs.pdl, gemv=knobs.expand_gemv)

    def shrink_all() -> list[Tensor]:
        if knobs.accumulate:
            workspace.zero_()
        hs, used = [], 0
        for x, _, sizes, ranks, a_offsets, _, _ in groups:
            hs.append(shrink(x, ranks, a_offsets, len(sizes) * rank, used))
            used += tokens * len(sizes) * rank
        return hs

    def layer_lora() -> None:
        # The layer's LoRA as the engine runs it: its shrinks, then its expands.
        for h, group in zip(shrink_all(), groups):
            expand(h, group)

    # Timing one kind alone: the shrinks of the layer, or its expands of h computed once beforehand.
    shrunk = shrink_all() if knobs.part == "expand" else []
    run = {"both": layer_lora, "shrink": shrink_all,
           "expand": lambda: [expand(h, group) for h, group in zip(shrunk, groups)]}[knobs.part]
    return LoraLayerStep(layer, slots, inputs, num_slots, run,
                         lambda x, ranks, a_offsets: shrink(x, ranks, a_offsets, rank, 0))


# ---- what a compiled kernel asks of a multiprocessor (ptx_loads.py) -------------------------------------------
# Registers are allocated per warp in units of this many (sm_90 and the generations before it).
REGISTER_UNIT = 256
# Shared memory the CUDA runtime reserves per block on sm_80 and later.
RESERVED_SHARED_PER_BLOCK = 1024


@dataclass(frozen=True)
class SmLimits:
    """One multiprocessor's limits; the defaults are the H100/H200's (sm_90)."""
    registers: int = 65536
    warps: int = 64
    blocks: int = 32
    shared_bytes: int = 233472

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @classmethod
    def of_device(cls, device: torch.device) -> SmLimits:
        import torch

        props = torch.cuda.get_device_properties(device)
        default = cls()
        return cls(registers=getattr(props, "regs_per_multiprocessor", default.registers),
                   warps=props.max_threads_per_multi_processor // 32,
                   shared_bytes=getattr(props, "shared_memory_per_multiprocessor", default.shared_bytes))


@dataclass(frozen=True)
class Occupancy:
    programs: int   # programs (thread blocks) resident on one multiprocessor at once
    bound: str      # what limits them: "registers", "warps", "shared memory" or "blocks"


def programs_per_sm(registers_per_thread: int, num_warps: int, shared_bytes: int,
                    limits: SmLimits = SmLimits()) -> Occupancy:
    """Programs of a kernel that one multiprocessor holds at once, and the resource that bounds them."""
    if registers_per_thread < 0 or num_warps < 1 or shared_bytes < 0:
        raise ValueError(f"need registers_per_thread >= 0, num_warps >= 1 and shared_bytes >= 0, got "
                         f"{registers_per_thread}, {num_warps}, {shared_bytes}")
    per_warp = -(-max(registers_per_thread, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by = {"registers": limits.registers // per_warp // num_warps,
          "warps": limits.warps // num_warps,
          "shared memory": limits.shared_bytes // (shared_bytes + RESERVED_SHARED_PER_BLOCK),
          "blocks": limits.blocks}
    bound = min(by, key=by.__getitem__)
    return Occupancy(by[bound], bound)


class CubinResources(NamedTuple):
    registers: int     # per thread
    stack_bytes: int   # per thread: the stack frame, where spilled registers go


def cubin_resources(cubin: bytes) -> CubinResources | None:
    """Registers and stack of a cubin's kernel, from cuobjdump (the one in Triton's wheel); None without it.
    Reads the compiled code itself, on any machine (ptx_loads.py compiles without a GPU)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        done = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                              timeout=60)
    found = re.search(r"REG:(\d+) STACK:(\d+)", done.stdout)
    return CubinResources(int(found.group(1)), int(found.group(2))) if found else None


def occupancy_columns(resources: CubinResources | None, num_warps: int, shared_bytes: int,
                      limits: SmLimits = SmLimits()) -> dict:
    """A compiled kernel's registers, stack, shared memory and warps, and the programs they leave room for
    on one multiprocessor (None where the registers are unknown)."""
    occupancy = programs_per_sm(resources.registers, num_warps, shared_bytes, limits) if resources else None
    return {"registers": resources.registers if resources else None,
            "stack_bytes": resources.stack_bytes if resources else None,
            "shared_bytes": shared_bytes, "num_warps": num_warps,
            "programs_per_sm": occupancy.programs if occupancy else None,
            "bound_by": occupancy.bound if occupancy else None,
            "warps_per_sm": occupancy.programs * num_warps if occupancy else None}
