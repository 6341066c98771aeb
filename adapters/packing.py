"""Packing an adapter into the unified pool's layout (DESIGN §2).

Per layer, an adapter's weights form one flat logical buffer: for each module in LORA_MODULES order,
the rows of A (`rank x in_features`) then the rows of Bᵀ (`rank x out_features`), every row starting at
a multiple of ALIGN. The buffer is cut into pages of `page_elems`; the same page ids serve every layer.
"""
from dataclasses import dataclass

import torch

from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import LoadedAdapter
from slora.kernels.layout import ALIGN, align_up


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

    @property
    def num_pages(self) -> int:
        return self.pages.shape[1]

    @property
    def num_bytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()


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
            ranks[layer, m], scalings[layer, m] = lora.rank, lora.scaling
            a_offsets[layer, m] = cursor
            cursor += lora.rank * align_up(in_features)
            b_offsets[layer, m] = cursor
            cursor += lora.rank * align_up(out_features)
        longest = max(longest, cursor)
    return AdapterDescriptor(ranks, a_offsets, b_offsets, scalings), longest


def pack_adapter(adapter: LoadedAdapter, shapes: TargetShapes, page_elems: int,
                 dtype: torch.dtype) -> PackedAdapter:
    """Lay the adapter out in pages of `page_elems` elements of `dtype`."""
    if page_elems % ALIGN:
        raise ValueError(f"page_elems={page_elems} must be a multiple of ALIGN={ALIGN}")
    descriptor, buffer_elems = buffer_layout(adapter, shapes)
    num_pages = -(-buffer_elems // page_elems)
    flat = torch.zeros(shapes.num_layers, num_pages * page_elems, dtype=dtype)
    for (layer, module), lora in adapter.weights.items():
        m = shapes.modules.index(module)
        _write_rows(flat[layer], int(descriptor.a_offsets[layer, m]), lora.lora_a)
        _write_rows(flat[layer], int(descriptor.b_offsets[layer, m]), lora.lora_b.T)
    return PackedAdapter(adapter.version, descriptor, flat.view(shapes.num_layers, num_pages, page_elems))


def _write_rows(buffer: torch.Tensor, offset: int, rows: torch.Tensor) -> None:
    """Write `rows` [num_rows, row_len] at `offset`, each row padded to a multiple of ALIGN."""
    num_rows, row_len = rows.shape
    stride = align_up(row_len)
    block = buffer[offset:offset + num_rows * stride].view(num_rows, stride)
    block[:, :row_len] = rows.to(buffer.dtype)
