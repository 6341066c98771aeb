"""Engine configuration, validated once at construction."""
import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FALLBACK_MEMORY_BYTES = 16 << 30      # where the OS does not say how much memory there is


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_MEMORY_BYTES


@dataclass
class EngineConfig:
    model: str | None = None                  # builtin name, HF folder or .gguf; None: DEFAULT_MODEL
    device: str = "cpu"
    dtype: str | None = None                  # default: float32 on the CPU, bfloat16 on CUDA
    page_size: int = 16
    pool_gib: float = 0.25                    # pool size on the CPU
    gpu_memory_utilization: float = 0.9       # share of GPU memory slora may use in total
    num_pages: int | None = None              # overrides the sizing rules (tests, simulations)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_lora_rank: int = 64
    max_loras: int | None = None              # distinct adapters in one batch (None: as many as sequences)
    graph_few_adapters: int = 4               # CUDA graphs: decode steps with at most this many distinct
                                              # adapters replay graphs sized for that many (0: never)
    lora_fused: bool = False                  # those graphs run each LoRA shrink + expand as one launch
                                              # (slower on the H200: benchmarks/README.md)
    pdl: bool = True                          # CUDA: the Triton kernels start while the kernel before them
                                              # ends (programmatic dependent launch; compute capability 9+)
    lora_side_stream: bool = True             # CUDA graphs: each LoRA runs on a second stream beside its
                                              # base GEMM, its delta added by the next op
    max_model_len: int | None = None          # default: what the model supports
    watermark: float = 0.01
    seed: int = 0
    enforce_eager: bool = False               # CUDA: no CUDA graphs for decode
    load_format: str = "safetensors"          # "dummy": random weights from config.json (benchmarks)
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"        # or "swap": preempted KV goes to host memory
    swap_space_gib: float = 1.0               # host swap space in swap mode
    adapter_host_cache_gib: float | None = None   # packed adapters kept in host memory (LRU by bytes);
                                                  # None: a quarter of the machine's memory

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available")
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.page_size < 8 or self.page_size > 128 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two from 8 to 128, got {self.page_size}")
        if self.pool_gib <= 0:
            raise ValueError(f"pool_gib must be positive, got {self.pool_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (or None for no limit), got {self.max_loras}")
        if self.graph_few_adapters < 0:
            raise ValueError(f"graph_few_adapters must be >= 0, got {self.graph_few_adapters}")
        if self.lora_fused and self.graph_few_adapters == 0:
            raise ValueError("lora_fused runs in the few-adapter decode graphs: it needs graph_few_adapters > 0")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.adapter_host_cache_gib is not None and self.adapter_host_cache_gib < 0:
            raise ValueError(f"adapter_host_cache_gib must be >= 0, got {self.adapter_host_cache_gib}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def adapter_host_cache_bytes(self) -> int:
        """The host tier's size: as configured, or a quarter of physical memory, so that thousands of
        adapters stay in host memory (as S-LoRA keeps them) on a serving machine without being configured."""
        if self.adapter_host_cache_gib is not None:
            return int(self.adapter_host_cache_gib * 2 ** 30)
        return physical_memory_bytes() // 4

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
