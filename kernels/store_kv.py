"""Triton kernel that writes new K and V rows into their slots of the paged pool (DESIGN §2, §4).

Same signature and semantics as `slora.kernels.reference.store_kv`, plus `pdl` (programmatic dependent
launch, `slora.kernels.pdl`: the slot is read before waiting for the previous kernel, K and V after). A
negative slot (padding tokens of a CUDA-graph batch) is skipped.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.layout import next_power_of_2
from slora.kernels.pdl import check_pdl_supported, launch_options, pdl_start, pdl_wait


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, pool_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    page_elems,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per token: copies its [NUM_KV_HEADS, HEAD_DIM] key and value into its page.
    token = tl.program_id(0)
    pdl_start(USE_PDL)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    pdl_wait(USE_PDL)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    idx = tl.arange(0, BLOCK)                       # flat index into [NUM_KV_HEADS, HEAD_DIM]
    mask = idx < NUM_KV_HEADS * HEAD_DIM
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    # A page is [2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM]: K then V. int64 because a layer of a large pool
    # may hold more than 2**31 elements.
    dst = pool_ptr + page * page_elems + offset * (NUM_KV_HEADS * HEAD_DIM) + idx
    elem = pool_ptr.dtype.element_ty
    tl.store(dst, key.to(elem), mask=mask)
    tl.store(dst + PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM, value.to(elem), mask=mask)


def _check_inputs(key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor, page_size: int) -> None:
    if key.dim() != 3:
        raise ValueError(f"key must be [tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    if kv_pool.dim() != 2:
        raise ValueError(f"kv_pool must be [num_pages, page_elems], got shape {tuple(kv_pool.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [tokens={key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    _, num_kv_heads, head_dim = key.shape
    if kv_pool.shape[1] != 2 * page_size * num_kv_heads * head_dim:
        raise ValueError(f"kv_pool page_elems {kv_pool.shape[1]} != 2 * page_size * num_kv_heads * head_dim "
                         f"= {2 * page_size * num_kv_heads * head_dim}")
    devices = {t.device for t in (key, value, kv_pool, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"key, value, kv_pool and slot_mapping must be on one device, got {devices}")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous in head_dim (stride 1)")
    if not kv_pool.is_contiguous() or not slot_mapping.is_contiguous():
        raise ValueError("kv_pool and slot_mapping must be contiguous")
    for name, t in (("key", key), ("value", value), ("kv_pool", kv_pool)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def store_kv(key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor, page_size: int, *,
             pdl: bool = False) -> None:
    """Write key/value `[tokens, num_kv_heads, head_dim]` into their slots of `kv_pool`
    `[num_pages, page_elems]`; `slot_mapping[t]` = page * page_size + offset, negative = skip."""
    _check_inputs(key, value, kv_pool, slot_mapping, page_size)
    check_pdl_supported(pdl, key.device)
    tokens, num_kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    block = next_power_of_2(num_kv_heads * head_dim)
    _store_kv_kernel[(tokens,)](
        key, value, kv_pool, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_pool.shape[1],
        PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=block, USE_PDL=pdl,
        num_warps=4 if block >= 512 else 1, **launch_options(pdl),
    )
