"""Triton `y = x @ Wᵀ` for the few rows of a decode step (DESIGN §4).

Same semantics as `slora.kernels.reference.linear` (`torch.nn.functional.linear` without bias). Decode
multiplies a handful of rows by every weight of the model, so a step is bound by streaming the weights;
the vendor GEMM's tile choices for 16-64 rows read them well below the copy bandwidth on the H200
(benchmarks/gemm.py). Each program here streams one BLOCK_N-row slab of W over one split of the
reduction, all of x's rows at once (x stays in L2); splits write float32 partial sums that a second
small launch adds up in a fixed order (deterministic, no atomics).
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

# Rows of x one launch takes: a decode step's batch, padded to a tensor-core tile.
MAX_ROWS = 64
# Programs we aim for per multiprocessor: enough bytes in flight to cover the memory latency.
_PROGRAMS_PER_SM = 4
_MAX_SPLIT_K = 16


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, rows, n_features, k_per_split, in_features,
    stride_xm, stride_wn, stride_split, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # out[split, m, n] = sum over this split's k of x[m, k] * W[n, k]; out is y itself when there is
    # one split, else a float32 [splits, rows, n] workspace.
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = m < rows, n < n_features
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + k < k_hi
        x = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + k)[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)                                              # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + (k0 + k)[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)      # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    o_ptrs = out_ptr + split * stride_split + m[:, None] * stride_om + n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, total, splits, stride_split, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    # out (flat, rows * n) = sum over splits of ws[split] (float32), in split order.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, SPLITS)
    mask = i < total
    parts = tl.load(ws_ptr + s[:, None] * stride_split + i[None, :], mask=(s < splits)[:, None] & mask[None, :],
                    other=0.0)                                              # [SPLITS, BLOCK]
    tl.store(out_ptr + i, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(x: Tensor, weight: Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [rows, in_features] and weight [out_features, in_features], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but weight expects {weight.shape[1]}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x and weight must share a float16/bfloat16/float32 dtype, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dimension (stride 1)")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")


def _choose_split_k(n_tiles: int, in_features: int, block_k: int, device: torch.device) -> int:
    """Splits of the reduction so that the launch has about _PROGRAMS_PER_SM programs per multiprocessor."""
    if device.type != "cuda":
        return 1
    target = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(target, n_tiles), _MAX_SPLIT_K, in_features // (4 * block_k)))


def skinny_linear(x: Tensor, weight: Tensor, *, block_n: int = 64, block_k: int = 128, split_k: int | None = None,
                  num_stages: int = 4, num_warps: int = 4) -> Tensor:
    """`x @ weightᵀ` `[rows, out_features]` in x's dtype, for at most MAX_ROWS rows.

    x: [rows, in_features]; weight: [out_features, in_features]. block_n, block_k, split_k, num_stages,
    num_warps: launch choices (benchmarks/gemm.py sweeps them)."""
    _check_inputs(x, weight)
    rows, in_features = x.shape
    n_features = weight.shape[0]
    out = torch.empty(rows, n_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    n_tiles = triton.cdiv(n_features, block_n)
    if split_k is None:
        split_k = _choose_split_k(n_tiles, in_features, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    target = out if split_k == 1 else torch.empty(split_k, rows, n_features, dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(rows))
    _skinny_linear_kernel[(n_tiles, split_k)](
        x, weight, target, rows, n_features, k_per_split, in_features,
        x.stride(0), weight.stride(0), target.stride(0) if split_k > 1 else 0, n_features,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_stages=num_stages, num_warps=num_warps)
    if split_k > 1:
        total, block = rows * n_features, 1024
        _sum_splits_kernel[(triton.cdiv(total, block),)](target, out, total, split_k, target.stride(0), BLOCK=block,
                                                         SPLITS=triton.next_power_of_2(split_k))
    return out
