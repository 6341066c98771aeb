"""The unified pool's memory (DESIGN §2): bytes per layer and page, seen as KV pages in the cache's dtype
and as adapter weights in the model's.

A page is `page_bytes` bytes in every layer: the K and V of `page_size` tokens in the cache dtype, or
`page_bytes / element size` elements of an adapter's weights in the model's dtype. With an FP8 cache a
page has half the bytes of a 16-bit one, so the same memory holds twice the pages. A layer kept in the
model's dtype beside an FP8 cache (`skip_layers`) needs `widening` times the bytes for its KV: its memory
is two halves of `num_pages` rows each, Ks in one and Vs in the other, and its adapter rows are the start
of the K half's rows.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from slora.execution.device_copy import to_device
from slora.kernels.layout import ALIGN
from slora.kernels.reference import KVCache, PagedKV


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype                                    # the model's: adapter weights, and KV unless FP8
    kv_dtype: torch.dtype | None = None                   # the cache's; None: the model's
    skip_layers: frozenset[int] = field(default_factory=frozenset)   # layers whose KV keeps the model's dtype

    def __post_init__(self) -> None:
        if self.skip_layers and not self.quantized:
            raise ValueError("skip layers keep some layers in the model's dtype beside an FP8 cache: they need "
                             "kv_cache_dtype fp8")
        bad = sorted(layer for layer in self.skip_layers if not 0 <= layer < self.num_layers)
        if bad:
            raise ValueError(f"skip layers {bad} are not layers of this model (0 to {self.num_layers - 1})")
        assert self.page_bytes % element_size(self.dtype) == 0 and self.page_elems % ALIGN == 0, \
            "a page holds whole ALIGN-wide runs of adapter elements"

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        return self.cache_dtype == torch.float8_e4m3fn

    @property
    def kv_elems(self) -> int:
        """K and V elements of one page of one layer."""
        return 2 * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer kept in the cache dtype."""
        return self.kv_elems * element_size(self.cache_dtype)

    @property
    def page_elems(self) -> int:
        """Adapter weight elements (the model's dtype) of one page of one layer."""
        return self.page_bytes // element_size(self.dtype)

    @property
    def widening(self) -> int:
        """How many times a skip layer's page outgrows a quantized one."""
        return element_size(self.dtype) // element_size(self.cache_dtype)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over every layer."""
        return self.page_bytes * (self.num_layers + (self.widening - 1) * len(self.skip_layers))

    def with_pages(self, num_pages: int) -> "PoolShape":
        return PoolShape(self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim, self.dtype,
                         self.kv_dtype, self.skip_layers)


class PoolViews(NamedTuple):
    """What a forward reads of the pool, per layer: adapter weights and KV pages (views of the same bytes)."""
    weights: tuple[Tensor, ...]         # [num_pages, page_elems] in the model's dtype
    kv: tuple[KVCache, ...]

    def paged_kv(self, layer: int, kv_locations: Tensor, page_size: int) -> PagedKV:
        """Where the step's new K/V of `layer` go."""
        cache = self.kv[layer]
        return PagedKV(cache.pages, kv_locations, page_size, cache.scales)


class PoolMemory:
    """The pool's bytes: one tensor for the layers in the cache dtype, one for the skip layers, and the scales
    of an FP8 cache (`[layers, 2, kv_heads]` float32, K's then V's, filled by the calibration)."""

    def __init__(self, shape: PoolShape, device: torch.device, swap_pages: int = 0) -> None:
        self.shape, self.device, self.swap_pages = shape, device, swap_pages
        self._swap: tuple[Tensor, Tensor] | None = None
        self._layers = [layer for layer in range(shape.num_layers) if layer not in shape.skip_layers]
        self._wide_layers = sorted(shape.skip_layers)
        half = shape.widening * shape.page_bytes // 2
        self._narrow = torch.zeros(len(self._layers), shape.num_pages, shape.page_bytes, dtype=torch.uint8,
                                   device=device)                                  # [layers, pages, page_bytes]
        self._wide = torch.zeros(len(self._wide_layers), 2, shape.num_pages, half, dtype=torch.uint8,
                                 device=device)                                    # [skip layers, K|V, pages, half]
        self.kv_scales = torch.ones(shape.num_layers, 2, shape.num_kv_heads, dtype=torch.float32, device=device)
        self.views = PoolViews(*zip(*(self._layer_views(layer) for layer in range(shape.num_layers))))

    @property
    def nbytes(self) -> int:
        return self._narrow.nbytes + self._wide.nbytes

    def contents(self) -> Tensor:
        """A copy of every byte of the pool, flat (tests compare the pool before and after)."""
        return torch.cat([self._narrow.flatten(), self._wide.flatten()])

    def _layer_views(self, layer: int) -> tuple[Tensor, KVCache]:
        shape = self.shape
        kv_shape = (shape.num_pages, 2, shape.page_size, shape.num_kv_heads, shape.head_dim)
        if layer in shape.skip_layers:
            memory = self._wide[self._wide_layers.index(layer)]                    # [2, pages, half]
            weights = memory[0, :, :shape.page_bytes].view(shape.dtype)
            halves = memory.view(shape.dtype).view(2, *kv_shape[:1], *kv_shape[2:])  # [K|V, pages, ps, heads, d]
            return weights, KVCache(halves.transpose(0, 1), None)
        memory = self._narrow[self._layers.index(layer)]                            # [pages, page_bytes]
        scales = self.kv_scales[layer] if shape.quantized else None
        return memory.view(shape.dtype), KVCache(memory.view(shape.cache_dtype).view(kv_shape), scales)

    def set_kv_scales(self, scales: Tensor) -> None:
        """An FP8 cache's scales `[layers, 2, kv_heads]`, in place (CUDA graphs read this very tensor)."""
        if scales.shape != self.kv_scales.shape:
            raise ValueError(f"KV scales must be [layers, 2, kv_heads] = {list(self.kv_scales.shape)}, "
                             f"got {list(scales.shape)}")
        self.kv_scales.copy_(scales)

    def copy_pages(self, sources: Tensor, targets: Tensor) -> None:
        """Copy-on-write: every layer's bytes of the source pages `[n]` into the target pages `[n]`."""
        self._narrow.index_copy_(1, targets, self._narrow.index_select(1, sources))
        self._wide.index_copy_(2, targets, self._wide.index_select(2, sources))

    def swap_out(self, pages: Tensor, slots: list[int]) -> None:
        """The bytes of pages `[n]` into host swap slots (made on first use), every layer's."""
        narrow, wide = self._swap_space()
        narrow[:, slots] = self._narrow.index_select(1, pages).to("cpu")
        wide[:, :, slots] = self._wide.index_select(2, pages).to("cpu")

    def swap_in(self, slots: list[int], pages: Tensor) -> None:
        """Swap slots' bytes back into pages `[n]`."""
        narrow, wide = self._swap_space()
        self._narrow.index_copy_(1, pages, to_device(narrow[:, slots], self.device))
        self._wide.index_copy_(2, pages, to_device(wide[:, :, slots], self.device))

    def _swap_space(self) -> tuple[Tensor, Tensor]:
        """Host pages for swapped-out KV, shaped as the pool's two tensors with `swap_pages` pages."""
        if self._swap is None:
            pin = self.device.type == "cuda"
            self._swap = (torch.empty(*self._narrow.shape[:1], self.swap_pages, *self._narrow.shape[2:],
                                      dtype=torch.uint8, pin_memory=pin),
                          torch.empty(*self._wide.shape[:2], self.swap_pages, *self._wide.shape[3:],
                                      dtype=torch.uint8, pin_memory=pin))
        return self._swap

    def load_weights(self, pages: Tensor, index: Tensor) -> None:
        """An adapter's packed pages `[layers, n, page_elems]` (the model's dtype, on this device) into the pool
        pages `index` `[n]`."""
        data = pages.contiguous().view(torch.uint8)                                 # [layers, n, page_bytes]
        self._narrow.index_copy_(1, index, data[self._layers])
        if self._wide_layers:
            self._wide[:, 0, :, :self.shape.page_bytes].index_copy_(1, index, data[self._wide_layers])

