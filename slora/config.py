"""Engine configuration, validated once at construction."""
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from slora.core.scheduler import PREEMPTION_MODES, SchedulerConfig
from slora.core.waiting import SCHEDULING_POLICIES

LOAD_FORMATS = ("safetensors", "dummy")     # "dummy": random weights from config.json
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")    # auto: the model's dtype; fp8 is E4M3
KV_SCALE_SOURCES = ("calibrate", "checkpoint", "ones")
_FALLBACK_MEMORY_BYTES = 16 << 30      # where the OS does not say how much memory there is


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_MEMORY_BYTES


def _option(default: object, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field; its help (and choices) become the command line's (slora.cli builds the options)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class CudaConfig:
    """Settings only a CUDA engine reads, passed whole to the parts that build the CUDA path."""

    gpu_memory_utilization: float = _option(0.9, "share of the GPU's memory slora may use in total")
    enforce_eager: bool = _option(False, "no CUDA graphs: decode and mixed steps run eagerly")
    pdl: bool = _option(True, "launch the Triton kernels with programmatic dependent launch (compute "
                              "capability 9.0+): each starts while the kernel before it ends")
    graph_few_adapters: int = _option(4, "decode steps with at most this many distinct adapters replay graphs "
                                         "sized for that many, with fewer LoRA programs (0: never)")
    lora_side_stream: bool = _option(True, "in decode graphs each LoRA runs on a second stream beside its base "
                                           "GEMM, its delta added by the next op")
    mixed_graph_tokens: int = _option(512, "steps with prefill rows of at most this many tokens replay a CUDA "
                                           "graph of their token bucket, attention included (0: never)")

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.graph_few_adapters < 0:
            raise ValueError(f"graph_few_adapters must be >= 0, got {self.graph_few_adapters}")
        if self.mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be >= 0, got {self.mixed_graph_tokens}")


@dataclass
class EngineConfig:
    model: str | None = _option(None, "SmolLM2-135M-Instruct (the default), slora-tiny-llama, a Hugging Face "
                                      "folder or a .gguf file")
    device: str = _option("cpu", "cpu or cuda")
    dtype: str | None = _option(None, "float32, bfloat16 or float16 (default: float32 on the CPU, bfloat16 on "
                                      "CUDA)")
    page_size: int = _option(16, "tokens per KV page")
    kv_cache_dtype: str = _option("auto", "the KV cache's dtype: auto (the model's) or fp8 (E4M3, scaled per layer "
                                          "and KV head): the same memory then holds twice the tokens",
                                  KV_CACHE_DTYPES)
    kv_cache_dtype_skip_layers: str | None = _option(None, "with an FP8 cache, the layers whose KV keeps the model's "
                                                           "dtype, comma-separated (e.g. 0,29)")
    kv_cache_scales: str = _option("calibrate", "an FP8 cache's scales: calibrate (from a pass over calibration "
                                                "prompts at start), checkpoint (the model's k_scale/v_scale "
                                                "tensors), ones, or a JSON file of them")
    pool_gib: float = _option(0.25, "pool size on the CPU")
    num_pages: int | None = _option(None, "pool size in pages (overrides the sizing rules)")
    max_num_seqs: int = _option(64, "sequences in one batch")
    max_beam_width: int = _option(16, "beams one beam-search request may run (each counts as a sequence)")
    max_num_batched_tokens: int | None = _option(None, "tokens in one step (default: 8192 on CUDA, as vLLM's server, "
                                                       "for GEMMs near the compute limit; 2048 on the CPU)")
    max_lora_rank: int = _option(64, "largest adapter rank taken")
    max_loras: int | None = _option(None, "distinct adapters in one batch (default: as many as sequences)")
    max_model_len: int | None = _option(None, "context length (default: what the model supports)")
    watermark: float = _option(0.01, "share of all pages kept free when admitting new requests")
    seed: int = _option(0, "seed of the sampling seeds of requests that give none")
    load_format: str = _option("safetensors", "dummy: random weights from config.json, drawn as vLLM's dummy loader "
                                              "draws them (benchmarks)", LOAD_FORMATS)
    enable_prefix_caching: bool = _option(True, "share the KV pages of common prompt prefixes")
    async_scheduling: bool = _option(True, "overlap the host's work for the next step with the GPU's step: the "
                                           "sampled ids stay on the device as the next step's inputs")
    preemption_mode: str = _option("recompute", "what a preempted sequence's KV becomes", PREEMPTION_MODES)
    scheduling_policy: str | None = _option(None, "the order of admission: fcfs (arrival), priority (a request's "
                                                  "priority, lower first, then arrival) or vtc (a fair share per "
                                                  "tenant by virtual token counters, priority within a tenant); "
                                                  "default: vtc when serving with a tenants file, else fcfs",
                                            SCHEDULING_POLICIES)
    vtc_prompt_cost: float = _option(1.0, "a tenant's charge per prompt token computed for it (vtc)")
    vtc_output_cost: float = _option(2.0, "a tenant's charge per token generated for it (vtc)")
    swap_space_gib: float = _option(1.0, "host swap space in swap mode")
    adapter_host_cache_gib: float | None = _option(None, "packed adapters kept in host memory, LRU by bytes "
                                                         "(default: a quarter of the machine's memory)")
    grammar_token_budget_ms: float = _option(50.0, "a structured-output row's grammar work (accepting its token, "
                                                    "filling its next mask) allowed per token")
    grammar_slow_tokens: int = _option(4, "tokens in a row over --grammar-token-budget-ms that end a request with "
                                          "an error naming its grammar")
    tensor_parallel_size: int = _option(1, "ranks the model is split over (Megatron's split: heads and MLP "
                                           "columns), one process each, one GPU each on CUDA (gloo on the CPU)")
    fully_sharded_loras: bool = _option(False, "under tensor parallelism, split adapters as S-LoRA does (A by rank "
                                               "on q/k/v and gate/up, with an all-gather of the shrink, and B by "
                                               "output on o and down); by default A is whole on column-parallel "
                                               "modules and B on row-parallel ones, and nothing more is sent")
    cuda: CudaConfig = field(default_factory=CudaConfig)

    def __post_init__(self) -> None:
        if self.max_beam_width < 1:
            raise ValueError(f"max_beam_width must be >= 1, got {self.max_beam_width}")
        if not self.grammar_token_budget_ms > 0 or self.grammar_slow_tokens < 1:
            raise ValueError("grammar_token_budget_ms must be > 0 and grammar_slow_tokens >= 1, got "
                             f"{self.grammar_token_budget_ms} and {self.grammar_slow_tokens}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available")
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.device == "cpu" else 8192
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.page_size < 8 or self.page_size > 128 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two from 8 to 128, got {self.page_size}")
        if self.pool_gib <= 0:
            raise ValueError(f"pool_gib must be positive, got {self.pool_gib}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.adapter_host_cache_gib is not None and self.adapter_host_cache_gib < 0:
            raise ValueError(f"adapter_host_cache_gib must be >= 0, got {self.adapter_host_cache_gib}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        self._check_kv_cache()
        self._check_tensor_parallel()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.scheduler_config()          # the scheduler's settings, checked by their owner now, not at start

    def _check_kv_cache(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales not in KV_SCALE_SOURCES and not self.kv_cache_scales.endswith(".json"):
            raise ValueError(f"kv_cache_scales must be one of {', '.join(KV_SCALE_SOURCES)} or a .json file, got "
                             f"{self.kv_cache_scales!r}")
        if self.kv_cache_skip_layers and self.torch_kv_cache_dtype is None:
            raise ValueError("kv_cache_dtype_skip_layers keeps layers in the model's dtype beside an FP8 cache: "
                             "set kv_cache_dtype fp8")
        if self.kv_cache_skip_layers and self.device != "cpu" and self.dtype == "float32":
            # A float32 skip layer's KV takes four FP8 pages' bytes, and its adapter rows are then strided, which
            # the LoRA kernels do not read (16-bit ones take two, and their adapter rows stay contiguous).
            raise ValueError("kv_cache_dtype_skip_layers needs 16-bit weights on CUDA (float32 runs on the CPU)")

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        if size > 1 and self.device != "cpu" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
        if size > 1 and self.device.startswith("cuda:"):
            raise ValueError("with tensor_parallel_size > 1, give device 'cuda': rank r runs on GPU r")

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype | None:
        """The cache's dtype when it is not the model's."""
        return None if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @property
    def kv_cache_skip_layers(self) -> frozenset[int]:
        """kv_cache_dtype_skip_layers as layer indices (which the model's shape checks)."""
        text = self.kv_cache_dtype_skip_layers or ""
        try:
            return frozenset(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise ValueError(f"kv_cache_dtype_skip_layers must be layer indices separated by commas, got "
                             f"{text!r}") from None

    def scheduler_config(self, swap_pages: int = 0, max_model_len: int | None = None) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.step_tokens, self.page_size, self.watermark,
                               self.enable_prefix_caching, self.preemption_mode, swap_pages,
                               max_loras=self.max_loras, max_model_len=max_model_len,
                               scheduling_policy=self.scheduling_policy or "fcfs",
                               prompt_cost=self.vtc_prompt_cost, output_cost=self.vtc_output_cost)

    @property
    def adapter_host_cache_bytes(self) -> int:
        """The host tier's size: as configured, or a quarter of physical memory, so that thousands of
        adapters stay in host memory (as S-LoRA keeps them) on a serving machine without being configured."""
        if self.adapter_host_cache_gib is not None:
            return int(self.adapter_host_cache_gib * 2 ** 30)
        return physical_memory_bytes() // 4

    @property
    def step_tokens(self) -> int:
        """max_num_batched_tokens, resolved."""
        assert self.max_num_batched_tokens is not None, "__post_init__ resolves the default"
        return self.max_num_batched_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype is not None, "__post_init__ resolves the default"
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


CUDA_FIELDS = frozenset(f.name for f in dataclasses.fields(CudaConfig))


def engine_config(**options: Any) -> EngineConfig:
    """An EngineConfig from flat keyword options, EngineConfig's fields and CudaConfig's alike
    (`mixed_graph_tokens=0` for `cuda=CudaConfig(mixed_graph_tokens=0)`), as LLM and the benchmarks take them."""
    cuda = {name: options.pop(name) for name in CUDA_FIELDS if name in options}
    if cuda:
        options["cuda"] = dataclasses.replace(options.get("cuda") or CudaConfig(), **cuda)
    return EngineConfig(**options)
