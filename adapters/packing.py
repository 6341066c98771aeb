"""Packing an adapter into the unified pool's layout (DESIGN §2).

Per layer, an adapter's weights form one flat logical buffer: for each module in the model's lora_modules order,
the rows of A (`rank x in_features`) then the rows of Bᵀ (`rank x out_features`), every row starting at
a multiple of ALIGN. The buffer is cut into pages of `page_elems`; the same page ids serve every layer.
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slora.adapters.errors import AdapterError
from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import LoadedAdapter, LoraWeights
from slora.kernels.layout import ALIGN, align_up

# The largest |A| and |B| * lora_scaling the pool may hold. Trained adapters' weights are well below 10
# (and B times its scaling rarely above 100); the bound leaves a hundredfold headroom over that yet
# stays below float16's largest value (65504), so a bounded weight is finite in every pool dtype.
MAX_PACKED_MAGNITUDE = 1e4


@dataclass(frozen=True)
class AdapterDescriptor:
    """Where each module's weights lie in the logical buffer; all `[num_layers, num_modules]`.
    A rank of 0 means the module is not targeted in that layer."""

    ranks: torch.Tensor        # int32
    a_offsets: torch.Tensor    # int64, element offset of the first row of A
    b_offsets: torch.Tensor    # int64, element offset of the first row of Bᵀ
    scalings: torch.Tensor     # float32


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter laid out page by page, ready to be copied into the pool: `pages` is
    `[num_layers, num_pages, page_elems]` on the host (the host-cache tier)."""

    version: str
    descriptor: AdapterDescriptor
    pages: torch.Tensor
    # Under tensor parallelism, the pages of ranks 1, 2, ...: their parts of the adapter, in the same layout
    # (`pages` is rank 0's part).
    rank_pages: tuple[torch.Tensor, ...] = ()

    @property
    def num_pages(self) -> int:
        return self.pages.shape[1]

    @property
    def num_bytes(self) -> int:
        return sum(pages.numel() * pages.element_size() for pages in (self.pages, *self.rank_pages))


def buffer_layout(adapter: LoadedAdapter, shapes: TargetShapes) -> tuple[AdapterDescriptor, int]:
    """Offsets of every module's rows, and the logical buffer length (the largest over layers)."""
    num_modules = len(shapes.modules)
    ranks = torch.zeros(shapes.num_layers, num_modules, dtype=torch.int32)
    a_offsets = torch.zeros(shapes.num_layers, num_modules, dtype=torch.int64)
    b_offsets = torch.zeros_like(a_offsets)
    scalings = torch.zeros(shapes.num_layers, num_modules, dtype=torch.float32)
    longest = 0
    for layer in range(shapes.num_layers):
        cursor = 0
        for m, module in enumerate(shapes.modules):
            lora = adapter.weights.get((layer, module))
            if lora is None:
                continue
            in_features, out_features = shapes.features(module)
            # The table's rank is A's (what the shrink reads). B has as many rows, except in a fully sharded
            # tensor-parallel part of a column-parallel module, whose B keeps every rank (slora.adapters.sharding).
            ranks[layer, m], scalings[layer, m] = lora.rank, lora.scaling
            a_offsets[layer, m] = cursor
            cursor += lora.rank * align_up(in_features)
            b_offsets[layer, m] = cursor
            cursor += lora.lora_b.shape[1] * align_up(out_features)
        longest = max(longest, cursor)
    return AdapterDescriptor(ranks, a_offsets, b_offsets, scalings), longest


class PackedBlock(NamedTuple):
    """One module's A or Bᵀ as packed, and the lora_scaling the kernels multiply by (None for A)."""

    name: str
    scaling: float | None
    values: torch.Tensor

    @property
    def factor(self) -> float:
        return 1.0 if self.scaling is None else self.scaling

    def describe(self, dtype: torch.dtype) -> str:
        scaled = "" if self.scaling is None else f" and times its lora_scaling {self.scaling:g}"
        return f"in {str(dtype).removeprefix('torch.')}{scaled}"


def pack_adapter(adapter: LoadedAdapter, shapes: TargetShapes, page_elems: int,
                 dtype: torch.dtype) -> PackedAdapter:
    """Lay the adapter out in pages of `page_elems` elements of `dtype`. Raises AdapterError if a weight,
    once in `dtype` (and times its lora_scaling for B), is non-finite or above MAX_PACKED_MAGNITUDE."""
    if page_elems % ALIGN:
        raise ValueError(f"page_elems={page_elems} must be a multiple of ALIGN={ALIGN}")
    descriptor, buffer_elems = buffer_layout(adapter, shapes)
    num_pages = -(-buffer_elems // page_elems)
    flat = torch.zeros(shapes.num_layers, num_pages * page_elems, dtype=dtype)
    blocks = [block for key, lora in adapter.weights.items()
              for block in _write_module(flat, descriptor, shapes, key, lora)]
    _check_packed_magnitudes(blocks, dtype)
    return PackedAdapter(adapter.version, descriptor, flat.view(shapes.num_layers, num_pages, page_elems))


def _write_module(flat: torch.Tensor, descriptor: AdapterDescriptor, shapes: TargetShapes,
                  key: tuple[int, str], lora: LoraWeights) -> tuple[PackedBlock, PackedBlock]:
    """Write one module's A and Bᵀ into its layer's buffer."""
    layer, module = key
    m = shapes.modules.index(module)
    name = shapes.qualified_name(layer, module)
    lora_a = _write_rows(flat[layer], int(descriptor.a_offsets[layer, m]), lora.lora_a)
    lora_b = _write_rows(flat[layer], int(descriptor.b_offsets[layer, m]), lora.lora_b.T)
    return PackedBlock(f"{name}.lora_A", None, lora_a), PackedBlock(f"{name}.lora_B", lora.scaling, lora_b)


def _write_rows(buffer: torch.Tensor, offset: int, rows: torch.Tensor) -> torch.Tensor:
    """Write `rows` [num_rows, row_len] at `offset`, each row padded to a multiple of ALIGN; returns the
    written block, padding included."""
    num_rows, row_len = rows.shape
    stride = align_up(row_len)
    block = buffer[offset:offset + num_rows * stride].view(num_rows, stride)
    block[:, :row_len] = rows.to(buffer.dtype)
    return block


def _check_packed_magnitudes(blocks: list[PackedBlock], dtype: torch.dtype) -> None:
    """What the kernels read, bounded: float64 weights of 1e300 become inf in a float16 pool, and a huge
    lora_scaling makes finite weights overflow in the kernels. One fused max-magnitude over all blocks."""
    if not blocks:
        return
    maxima = torch.stack(torch._foreach_norm([b.values for b in blocks], ord=math.inf, dtype=torch.float64))
    scaled = maxima * torch.tensor([b.factor for b in blocks], dtype=torch.float64)
    bad = torch.nonzero(~(scaled <= MAX_PACKED_MAGNITUDE))       # NaN compares false: refused too
    if len(bad):
        block, largest = blocks[int(bad[0])], float(scaled[bad[0]])
        raise AdapterError(f"tensor {block.name!r}: {block.describe(dtype)}, its largest magnitude is "
                           f"{largest:g}, above {MAX_PACKED_MAGNITUDE:g}")
