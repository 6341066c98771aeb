"""Input checks shared by the kernels' wrappers (they raise ValueError naming the problem)."""
import torch
from torch import Tensor

# The LoRA kernels index an adapter's pool elements (its pages times page_elems) in int32.
MAX_ADAPTER_ELEMS = 2 ** 31
# Output columns per program of the one-token LoRA expand (lora_expand(gemv=True)), on pages at least this
# wide: 8 columns (a 16-byte load of bfloat16) per thread of 4 warps.
LORA_GEMV_TILE = 1024


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_adapter_span(pages: int, page_elems: int, what: str) -> None:
    """An adapter's pages must hold fewer than MAX_ADAPTER_ELEMS elements; `what` names the adapter."""
    if pages * page_elems >= MAX_ADAPTER_ELEMS:
        raise ValueError(f"{what} spans {pages} pages of {page_elems} elements; the LoRA kernels index an "
                         f"adapter in int32, so it must span fewer than 2**31 elements")


def check_query_and_pool(query: Tensor, kv_pool: Tensor, page_size: int, num_kv_heads: int,
                         query_shape: str) -> None:
    """query `[rows, num_heads, head_dim]` and one layer of the pool as KV (check_kv_pool)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [{query_shape}, num_heads, head_dim], got shape {tuple(query.shape)}")
    _, num_heads, head_dim = query.shape
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if not is_power_of_two(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    check_kv_pool(kv_pool, page_size, num_kv_heads, head_dim)
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if not kv_pool.is_floating_point():
        raise ValueError(f"kv_pool must be floating point, got {kv_pool.dtype}")
    if query.stride(2) != 1:
        raise ValueError("query must be contiguous in head_dim (stride 1)")


def check_kv_pool(kv_pool: Tensor, page_size: int, num_kv_heads: int, head_dim: int) -> None:
    """One layer of the pool as pages of K and V, each `[page_size, num_kv_heads, head_dim]`: `[num_pages,
    page_elems]` contiguous, or the page view `[num_pages, 2, page_size, num_kv_heads, head_dim]` whose last
    three dims are contiguous (its page and K/V strides are free: a layer may keep its Ks and its Vs in two
    halves of its memory). 8-bit floats only as float8_e4m3fn (the FP8 cache, check_kv_scales)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if kv_pool.dim() == 5:
        _check_kv_page_view(kv_pool, page_size, num_kv_heads, head_dim)
    else:
        page_elems = 2 * page_size * num_kv_heads * head_dim
        if kv_pool.dim() != 2 or kv_pool.shape[1] != page_elems:
            raise ValueError(f"kv_pool must be [num_pages, page_elems = 2 * page_size * num_kv_heads * head_dim = "
                             f"{page_elems}] or [num_pages, 2, page_size, num_kv_heads, head_dim], got shape "
                             f"{tuple(kv_pool.shape)}")
        if not kv_pool.is_contiguous():
            raise ValueError("kv_pool must be contiguous")
    if kv_pool.element_size() == 1 and kv_pool.dtype != torch.float8_e4m3fn:
        raise ValueError(f"an 8-bit kv_pool must be float8_e4m3fn, got {kv_pool.dtype}")


def _check_kv_page_view(kv_pool: Tensor, page_size: int, num_kv_heads: int, head_dim: int) -> None:
    want = (2, page_size, num_kv_heads, head_dim)
    if tuple(kv_pool.shape[1:]) != want:
        raise ValueError(f"a 5-d kv_pool must be [num_pages, 2, page_size, num_kv_heads, head_dim] = "
                         f"[num_pages, {', '.join(map(str, want))}], got shape {tuple(kv_pool.shape)}")
    if kv_pool.stride()[2:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError(f"a 5-d kv_pool must be contiguous in its last three dims (page_size, num_kv_heads, "
                         f"head_dim), got strides {kv_pool.stride()}")


def check_kv_scales(kv_pool: Tensor, kv_scales: Tensor | None, num_kv_heads: int) -> None:
    """An FP8 (float8_e4m3fn) kv_pool comes with its scales, float32 `[2, num_kv_heads]` (K's, then V's)
    contiguous on the pool's device; any other pool comes without."""
    if kv_pool.dtype != torch.float8_e4m3fn:
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for an FP8 (float8_e4m3fn) kv_pool, got a {kv_pool.dtype} kv_pool")
        return
    if kv_scales is None:
        raise ValueError("an FP8 (float8_e4m3fn) kv_pool needs kv_scales, float32 [2, num_kv_heads]")
    if tuple(kv_scales.shape) != (2, num_kv_heads) or kv_scales.dtype != torch.float32:
        raise ValueError(f"kv_scales must be float32 [2, num_kv_heads={num_kv_heads}], got {kv_scales.dtype} of "
                         f"shape {tuple(kv_scales.shape)}")
    if not kv_scales.is_contiguous():
        raise ValueError("kv_scales must be contiguous")
    check_one_device(kv_pool=kv_pool, kv_scales=kv_scales)


def check_int_tensors(**tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")


def check_one_device(**tensors: Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        names = ", ".join(tensors)
        raise ValueError(f"{names} must be on one device, got {devices}")
