"""Torch reference versions of every kernel (DESIGN §4).

These run on any device and define the semantics that the Triton kernels must match. The CPU engine
uses them directly. Conventions:

- `kv_pool` is one layer of the unified pool as KV, `[num_pages, page_elems]` (a page viewed as `[2, page_size,
  num_kv_heads, head_dim]`, K then V), or already that view, `[num_pages, 2, page_size, num_kv_heads,
  head_dim]`, whose first two strides are free (a layer kept in 16 bits beside an FP8 cache holds its Ks and
  its Vs in two halves of its memory).
- An FP8 cache (`float8_e4m3fn`) comes with `kv_scales` `[2, num_kv_heads]` float32, K's then V's: a stored
  value times its head's scale is the real one. Storing divides by the scale and rounds to nearest even,
  clamped to E4M3's largest finite value, 448.
- A sequence's `block_table` row lists its pages; token position `i` is on page `block_table[i // page_size]`,
  offset `i % page_size`. `kv_locations` holds each token.s pool location `page * page_size + offset`.
- LoRA weights are read through per-adapter `page_tables` (rows of page ids): element `e` of an
  adapter's logical buffer is `pool[page_table[e // page_elems], e % page_elems]`. Row `i` of a matrix
  whose rows have `n` elements starts at `offset + i * align_up(n)`.
- `token_slots[t]` is the step-local adapter slot of token `t`, or -1 for no adapter.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from slora.kernels.layout import align_up

FP8_MAX = 448.0      # float8_e4m3fn's largest finite value


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x (any float dtype) over `scale` (broadcast against x), rounded to float8_e4m3fn, clamped to +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def kv_page_view(kv_pool: Tensor, page_size: int, num_kv_heads: int) -> Tensor:
    """View one layer of the pool as KV pages: [num_pages, 2, page_size, num_kv_heads, head_dim] (a 5-d
    kv_pool is that view already)."""
    if kv_pool.dim() == 5:
        return kv_pool
    num_pages, page_elems = kv_pool.shape
    head_dim = page_elems // (2 * page_size * num_kv_heads)
    assert 2 * page_size * num_kv_heads * head_dim == page_elems, "page_elems does not match the KV shape"
    return kv_pool.view(num_pages, 2, page_size, num_kv_heads, head_dim)


class KVCache(NamedTuple):
    """One layer's KV pages in the cache dtype, and their scales when it is FP8."""
    pages: Tensor                     # [num_pages, 2, page_size, num_kv_heads, head_dim]
    scales: Tensor | None = None      # [2, num_kv_heads] float32


class PagedKV(NamedTuple):
    """Where a step's new K/V rows go: one layer of the pool, each token's location in it, and the layer's
    scales when its cache is FP8."""
    kv_pool: Tensor          # [num_pages, page_elems] or [num_pages, 2, page_size, num_kv_heads, head_dim]
    kv_locations: Tensor     # [tokens] int32 or int64; negative: a padding token, not stored
    page_size: int
    kv_scales: Tensor | None = None   # [2, num_kv_heads] float32: an FP8 cache's


def stored_kv(x: Tensor, dtype: torch.dtype, scales: Tensor | None) -> Tensor:
    """x `[tokens, num_kv_heads, head_dim]` as the cache holds it: in its dtype, quantized by the heads' scales
    `[num_kv_heads]` when it is FP8."""
    if scales is None:
        return x.to(dtype)
    return quantize_fp8(x, scales[None, :, None])


def store_kv(key: Tensor, value: Tensor, kv_pool: Tensor, kv_locations: Tensor, page_size: int,
             kv_scales: Tensor | None = None) -> None:
    """Write key/value `[tokens, num_kv_heads, head_dim]` into their locations in `kv_pool` (quantized by
    `kv_scales` into an FP8 cache). A negative location (a padding token) is skipped."""
    pages = kv_page_view(kv_pool, page_size, key.shape[1])
    keep = kv_locations >= 0  # without this, location -1 would silently overwrite the last page
    kv_locations = kv_locations.long()[keep]
    page_ids, offsets = kv_locations // page_size, kv_locations % page_size
    k_scales, v_scales = (None, None) if kv_scales is None else kv_scales
    pages[page_ids, 0, offsets] = stored_kv(key[keep], pages.dtype, k_scales)
    pages[page_ids, 1, offsets] = stored_kv(value[keep], pages.dtype, v_scales)


def _attend(query: Tensor, key: Tensor, value: Tensor, scale: float, query_positions: Tensor,
            key_valid: Tensor) -> Tensor:
    """Batched causal GQA attention, in float32.

    query `[seqs, q, heads, head_dim]` at absolute `query_positions` `[seqs, q]`; key/value
    `[seqs, ctx, kv_heads, head_dim]` at positions 0..ctx-1, of which `key_valid` `[seqs, ctx]` exist."""
    group = query.shape[2] // key.shape[2]
    key = key.float().repeat_interleave(group, dim=2)       # [seqs, ctx, heads, head_dim]
    # Slots past a sequence's length hold whatever the pool holds (maybe NaN/inf): zero them, since
    # a zero probability times NaN would still be NaN.
    value = value.float().masked_fill(~key_valid[:, :, None, None], 0.0).repeat_interleave(group, dim=2)
    scores = torch.einsum("sqhd,skhd->shqk", query.float(), key) * scale   # [seqs, heads, q, ctx]
    k_pos = torch.arange(key.shape[1], device=query.device)
    allowed = (k_pos[None, None, :] <= query_positions[:, :, None]) & key_valid[:, None, :]  # [seqs, q, ctx]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)    # padded query rows have no allowed key
    return torch.einsum("shqk,skhd->sqhd", probs, value)      # [seqs, q, heads, head_dim]


def _gather_batch_kv(kv_pool: Tensor, block_tables: Tensor, context_lens: Tensor, page_size: int,
                     num_kv_heads: int, kv_scales: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """K and V `[seqs, max_ctx, kv_heads, head_dim]` of every sequence (float32, dequantized, when the cache
    is FP8), and which slots exist."""
    pages = kv_page_view(kv_pool, page_size, num_kv_heads)
    max_ctx = int(context_lens.max())
    positions = torch.arange(max_ctx, device=kv_pool.device)
    valid = positions[None, :] < context_lens[:, None].long()                  # [seqs, max_ctx]
    page_cols = (positions // page_size).clamp(max=block_tables.shape[1] - 1)
    page_ids = block_tables.long()[:, page_cols] * valid                       # padded slots read page 0
    offsets = (positions % page_size).expand_as(page_ids)
    key, value = pages[page_ids, 0, offsets], pages[page_ids, 1, offsets]
    if kv_scales is None:
        return key, value, valid
    return key.float() * kv_scales[0, :, None], value.float() * kv_scales[1, :, None], valid


def paged_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, context_lens: Tensor,
                    page_size: int, num_kv_heads: int, scale: float, kv_scales: Tensor | None = None) -> Tensor:
    """Decode attention: query `[batch, num_heads, head_dim]`, one token per sequence, attending to
    the `context_lens[b]` tokens of its block table (its own token included). Returns the same shape."""
    if query.shape[0] == 0:
        return torch.empty_like(query)                                           # as the kernel: no sequence
    key, value, valid = _gather_batch_kv(kv_pool, block_tables, context_lens, page_size, num_kv_heads, kv_scales)
    positions = (context_lens.long() - 1)[:, None]                               # [batch, 1]
    return _attend(query[:, None], key, value, scale, positions, valid)[:, 0].to(query.dtype)


def prefill_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                      context_lens: Tensor, page_size: int, num_kv_heads: int, scale: float,
                      kv_scales: Tensor | None = None) -> Tensor:
    """Causal attention of the new tokens of many sequences over a paged cache that may hold a prefix.

    query: `[total_new_tokens, num_heads, head_dim]`, sequence `s` owning rows
    `query_start_loc[s]:query_start_loc[s+1]`; those are the last tokens of its `context_lens[s]`
    tokens, whose K/V (prefix and new) are already in the cache."""
    starts = query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]                                        # [seqs]
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=query.device), query_lens)
    row_in_seq = torch.arange(query.shape[0], device=query.device) - starts[seq_of_token]
    padded = query.new_zeros(len(query_lens), int(query_lens.max()), *query.shape[1:])  # [seqs, max_q, h, d]
    padded[seq_of_token, row_in_seq] = query
    first = context_lens.long() - query_lens                                     # position of each first row
    positions = first[:, None] + torch.arange(padded.shape[1], device=query.device)[None, :]
    positions = torch.where(positions < context_lens.long()[:, None], positions, -1)   # padding sees nothing
    key, value, valid = _gather_batch_kv(kv_pool, block_tables, context_lens, page_size, num_kv_heads, kv_scales)
    out = _attend(padded, key, value, scale, positions, valid)
    return out[seq_of_token, row_in_seq].to(query.dtype)


def gather_lora_rows(pool: Tensor, page_tables: Tensor, offsets: Tensor, ranks: Tensor, max_rank: int,
                     row_len: int) -> Tensor:
    """Rows `[slots, max_rank, row_len]` of one matrix of every slot's adapter, read through its page
    table; rows at or beyond a slot's rank are zero. Row i starts at `offsets[s] + i * align_up(row_len)`."""
    page_elems = pool.shape[1]
    device = pool.device
    rows = torch.arange(max_rank, device=device)
    elems = (offsets.long()[:, None, None] + rows[None, :, None] * align_up(row_len)
             + torch.arange(row_len, device=device)[None, None, :])              # [slots, max_rank, row_len]
    live = rows[None, :] < ranks.long()[:, None]                                  # [slots, max_rank]
    page_cols = (elems // page_elems).clamp(max=page_tables.shape[1] - 1) * live[:, :, None]
    page_ids = torch.gather(page_tables.long(), 1, page_cols.flatten(1)).view_as(elems)
    # where, not multiply: rows past the rank read unrelated pool memory, which may hold NaN/inf.
    return torch.where(live[:, :, None], pool[page_ids, elems % page_elems], 0)


def lora_shrink(x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                a_offsets: Tensor, max_rank: int) -> Tensor:
    """h[t, :r] = x[t] @ A_sᵀ for s = token_slots[t] of rank r; zero elsewhere. Returns [tokens, max_rank].

    With `[modules, slots]` ranks and offsets (modules sharing x, like q/k/v): `[tokens, modules * max_rank]`,
    module m in columns m*max_rank onwards."""
    if ranks.dim() == 2:
        return torch.cat([lora_shrink(x, pool, token_slots, page_tables, r, o, max_rank)
                          for r, o in zip(ranks, a_offsets)], dim=1)
    lora_a = gather_lora_rows(pool, page_tables, a_offsets, ranks, max_rank, x.shape[1]).to(x.dtype)
    # Every token through every slot's A in one matmul (slots are few), then keep its own slot's block.
    every = (x @ lora_a.flatten(0, 1).T).view(x.shape[0], *lora_a.shape[:2])    # [tokens, slots, max_rank]
    tokens = torch.arange(x.shape[0], device=x.device)
    h = every[tokens, token_slots.long().clamp(min=0)]                           # [tokens, max_rank]
    return h * (token_slots >= 0)[:, None]


def lora_expand(out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                ranks: Tensor, b_offsets: Tensor, scalings: Tensor, out_sizes: list[int] | None = None,
                add: bool = True) -> None:
    """out[t] += (h[t, :r] @ Bᵀ_s) * scaling_s for s = token_slots[t]; tokens with slot -1 untouched.
    add=False: the rows of tokens with an adapter are set to the delta instead (0 where rank 0).

    With `[modules, slots]` tables: module m reads h's m-th equal column block and adds into its
    `out_sizes[m]` columns of out (the modules' outputs side by side, like the fused qkv output)."""
    if not add:
        delta = torch.zeros_like(out)
        lora_expand(delta, h, pool, token_slots, page_tables, ranks, b_offsets, scalings, out_sizes)
        rows = token_slots >= 0
        out[rows] = delta[rows]
        return
    if ranks.dim() == 2:
        width = h.shape[1] // ranks.shape[0]
        for m, (cols, h_m) in enumerate(zip(out.split(out_sizes, dim=1), h.split(width, dim=1))):
            lora_expand(cols, h_m, pool, token_slots, page_tables, ranks[m], b_offsets[m], scalings[m])
        return
    lora_bt = gather_lora_rows(pool, page_tables, b_offsets, ranks, h.shape[1], out.shape[1]).to(h.dtype)
    slots = token_slots.long().clamp(min=0)
    has_adapter = token_slots >= 0
    # Place each token's h in its slot's block of a wide row, so one matmul applies every Bᵀ.
    wide = h.new_zeros(h.shape[0], *lora_bt.shape[:2])                           # [tokens, slots, max_rank]
    wide[torch.arange(h.shape[0], device=h.device), slots] = h * has_adapter[:, None]
    delta = wide.flatten(1) @ lora_bt.flatten(0, 1)                              # [tokens, out]
    scale = scalings.to(h.dtype)[slots] * has_adapter                            # [tokens]
    out += delta * scale[:, None]


def add_lora_delta(x: Tensor, delta: Tensor | None, token_slots: Tensor | None) -> Tensor:
    """x with the LoRA delta added (in x's dtype) in the rows of tokens with an adapter (slot >= 0): what
    the elementwise ops below do first when given a delta (`lora_expand(add=False)` wrote it)."""
    if delta is None:
        return x
    assert token_slots is not None, "a delta comes with the step's token slots"
    return torch.where((token_slots >= 0)[:, None], x + delta, x)


def rms_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None,
             token_slots: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weight * rms_norm(x + delta), x + delta) for x `[tokens, hidden]` and weight `[hidden]`. The sum is
    taken in x's dtype and the norm in float32, then rounded to x's dtype; without delta, the second item is
    `x` itself. delta: see add_lora_delta."""
    x = add_lora_delta(x, delta, token_slots)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed, x


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `[tokens, heads, head_dim]` rotated by cos/sin `[tokens, head_dim]` in x's dtype (the
    half-split layout of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_qk_(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               delta: Tensor | None = None, token_slots: Tensor | None = None, kv: PagedKV | None = None) -> None:
    """Rotate the q heads (first `num_heads`) and k heads (next `num_kv_heads`) of the fused qkv output
    `[tokens, (num_heads + 2 * num_kv_heads) * head_dim]` in place by cos/sin `[tokens, head_dim]`;
    without delta, the v columns are untouched. delta: added to q, k and v first (see add_lora_delta).
    kv: then every token's k (rotated) and v are stored into its slot of the pool (store_kv)."""
    if delta is not None:
        qkv.copy_(add_lora_delta(qkv, delta, token_slots))
    for start, heads in ((0, num_heads), (num_heads * head_dim, num_kv_heads)):
        cols = qkv[:, start:start + heads * head_dim]                             # [tokens, heads * head_dim]
        cols.copy_(apply_rotary(cols.unflatten(1, (heads, head_dim)), cos, sin).flatten(1))
    if kv is not None:
        _, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        shape = (qkv.shape[0], num_kv_heads, head_dim)
        store_kv(key.view(shape), value.view(shape), *kv)


def silu_and_mul(gate_up: Tensor, delta: Tensor | None = None, token_slots: Tensor | None = None) -> Tensor:
    """silu(gate) * up for gate_up `[tokens, 2 * inter]` (gate columns first), in gate_up's dtype.
    Returns a new contiguous `[tokens, inter]` tensor. delta: see add_lora_delta."""
    gate, up = add_lora_delta(gate_up, delta, token_slots).chunk(2, dim=-1)
    return (F.silu(gate) * up).contiguous()


def logprob_rows(logits: Tensor, tokens: Tensor, top: int) -> Tensor:
    """`[rows, 3 + 2 * top]` float64: per row of `logits` `[rows, vocab]`, token `tokens[row]`'s id, its
    logprob under log_softmax of the row, its rank (1 + the logits strictly above it), then the `top` best
    ids, then their logprobs. The log-normaliser is taken once per row, so no `[rows, vocab]` logprobs are
    written; float64 holds the ids exactly (< 2**53)."""
    logits = logits.float()
    normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)                     # [rows, 1]
    chosen = logits.gather(1, tokens[:, None])                                      # [rows, 1]
    ranks = (logits > chosen).sum(dim=-1, keepdim=True) + 1                         # [rows, 1]
    columns = [tokens[:, None].double(), (chosen - normaliser).double(), ranks.double()]
    if top:
        best = logits.topk(top, dim=-1)                                             # [rows, top]
        columns += [best.indices.double(), (best.values - normaliser).double()]
    return torch.cat(columns, dim=1)
