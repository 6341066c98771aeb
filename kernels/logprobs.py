"""The logprob rows of a step in two launches: each sampled (or prompt) token's logprob under log_softmax
of its row, its rank, and the row's `top` best tokens with their logprobs, packed as `reference.logprob_rows`
packs them. Torch needs a launch per reduction (the log-normaliser alone takes several passes over the
`[rows, vocab]` logits, top-k a radix select); here one pass over the logits by `SPLIT`-column programs
keeps each split's max, sum of exponentials, count of logits above the token's and its `top` best, and a
second launch per row combines the splits.

Same signature and semantics as `slora.kernels.reference.logprob_rows`. Among equal logits the top tokens
come lowest id first; ranks count the logits strictly above the token's.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from slora.kernels.layout import cdiv, next_power_of_2

SPLIT = 4096                  # logit columns per program of the first pass
MAX_TOP = 20                  # the most top logprobs a row can ask for (OpenAI's top_logprobs bound)
# `top` is not specialised (Triton would compile top == 1 and top % 16 == 0 apart), so the one variant the
# engine compiles at start serves every request's top_logprobs.


@triton.jit(do_not_specialize=["top"])
def _split_stats_kernel(
    logits_ptr, tokens_ptr, max_ptr, sum_ptr, count_ptr, top_val_ptr, top_idx_ptr,
    stride, vocab, splits, top, BLOCK: tl.constexpr,
):
    # Program (row, split): the split's BLOCK logits, reduced to its max, its sum of exp(x - max), how many
    # exceed the row's token's logit, and its `top` best (value, column), found by repeated max.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    cols = split * BLOCK + lanes
    x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    chosen = tl.load(logits_ptr + row * stride + tl.load(tokens_ptr + row)).to(tl.float32)
    peak = tl.max(x, axis=0)
    shift = tl.where(peak == float("-inf"), 0.0, peak)        # a split of -inf only: its sum is 0, not NaN
    out = row * splits + split
    tl.store(max_ptr + out, peak)
    tl.store(sum_ptr + out, tl.sum(tl.exp(x - shift), axis=0))
    tl.store(count_ptr + out, tl.sum((x > chosen).to(tl.int32), axis=0))
    for i in range(top):
        best = tl.max(x, axis=0)
        lane = tl.min(tl.where(x == best, lanes, BLOCK), axis=0)     # the lowest column among equals
        tl.store(top_val_ptr + out * top + i, best)
        tl.store(top_idx_ptr + out * top + i, split * BLOCK + lane)
        x = tl.where(lanes == lane, float("-inf"), x)


@triton.jit(do_not_specialize=["top"])
def _combine_kernel(
    logits_ptr, tokens_ptr, max_ptr, sum_ptr, count_ptr, top_val_ptr, top_idx_ptr, out_ptr,
    stride, splits, top, SPLITS: tl.constexpr, CANDIDATES: tl.constexpr,
):
    # Program per row: the log-normaliser from the splits' (max, sum), the token's logprob and rank, and the
    # row's `top` best of the splits' candidates, written as one float64 row [3 + 2 * top]. CANDIDATES
    # is sized for MAX_TOP, so that one compiled variant serves every `top`.
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, SPLITS)
    peaks = tl.load(max_ptr + row * splits + parts, mask=parts < splits, other=float("-inf"))
    sums = tl.load(sum_ptr + row * splits + parts, mask=parts < splits, other=0.0)
    peak = tl.max(peaks, axis=0)
    total = tl.sum(sums * tl.exp(peaks - peak), axis=0)
    normaliser = peak + tl.log(total)
    token = tl.load(tokens_ptr + row)
    chosen = tl.load(logits_ptr + row * stride + token).to(tl.float32)
    rank = tl.sum(tl.load(count_ptr + row * splits + parts, mask=parts < splits, other=0), axis=0) + 1
    width = 3 + 2 * top
    tl.store(out_ptr + row * width, token.to(tl.float64))
    tl.store(out_ptr + row * width + 1, (chosen - normaliser).to(tl.float64))
    tl.store(out_ptr + row * width + 2, rank.to(tl.float64))
    slots = tl.arange(0, CANDIDATES)
    n = splits * top
    values = tl.load(top_val_ptr + row * n + slots, mask=slots < n, other=float("-inf"))
    columns = tl.load(top_idx_ptr + row * n + slots, mask=slots < n, other=0)
    for i in range(top):
        best = tl.max(values, axis=0)
        column = tl.min(tl.where(values == best, columns, 2 ** 31 - 1), axis=0)   # the lowest id among equals
        tl.store(out_ptr + row * width + 3 + i, column.to(tl.float64))
        tl.store(out_ptr + row * width + 3 + top + i, (best - normaliser).to(tl.float64))
        values = tl.where((values == best) & (columns == column), float("-inf"), values)


def logprob_rows(logits: Tensor, tokens: Tensor, top: int) -> Tensor:
    """`[rows, 3 + 2 * top]` float64: per row of `logits` `[rows, vocab]` (CUDA, float32/16), token
    `tokens[row]`'s id, logprob and rank, then the `top` best ids, then their logprobs."""
    _check(logits, tokens, top)
    rows, vocab = logits.shape
    splits = cdiv(vocab, SPLIT)
    device = logits.device
    maxes = torch.empty(rows, splits, dtype=torch.float32, device=device)
    sums = torch.empty_like(maxes)
    counts = torch.empty(rows, splits, dtype=torch.int32, device=device)
    top_values = torch.empty(rows, splits, max(top, 1), dtype=torch.float32, device=device)
    top_columns = torch.empty(rows, splits, max(top, 1), dtype=torch.int32, device=device)
    out = torch.empty(rows, 3 + 2 * top, dtype=torch.float64, device=device)
    if rows == 0:
        return out
    stats = (maxes, sums, counts, top_values, top_columns)
    _split_stats_kernel[(rows, splits)](logits, tokens, *stats, logits.stride(0), vocab, splits, top,
                                        BLOCK=SPLIT, num_warps=8)
    _combine_kernel[(rows,)](logits, tokens, *stats, out, logits.stride(0), splits, top,
                             SPLITS=next_power_of_2(splits), CANDIDATES=next_power_of_2(splits * MAX_TOP))
    return out


def _check(logits: Tensor, tokens: Tensor, top: int) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if tokens.shape != (logits.shape[0],) or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be [{logits.shape[0]}] int64, got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.device != logits.device:
        raise ValueError(f"tokens on {tokens.device}, logits on {logits.device}")
    if not 0 <= top <= MAX_TOP or top > logits.shape[1]:
        raise ValueError(f"top must be in [0, {min(MAX_TOP, logits.shape[1])}], got {top}")
