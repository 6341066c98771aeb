"""Torch reference versions of every kernel (DESIGN §4).

These run on any device and define the semantics that the Triton kernels must match. The CPU engine
uses them directly. Conventions:

- `kv_pool` is one layer of the unified pool, `[num_pages, page_elems]`; as KV a page is viewed as
  `[2, page_size, num_kv_heads, head_dim]` (K then V).
- A sequence's `block_table` row lists its pages; token slot `i` is page `block_table[i // page_size]`,
  offset `i % page_size`. `slot_mapping` holds global slots `page * page_size + offset`.
- LoRA weights are read through per-adapter `page_tables` (rows of page ids): element `e` of an
  adapter's logical buffer is `pool[page_table[e // page_elems], e % page_elems]`. Row `i` of a matrix
  whose rows have `n` elements starts at `offset + i * align_up(n)`.
- `token_slots[t]` is the step-local adapter slot of token `t`, or -1 for no adapter.
"""
import torch
from torch import Tensor

from slora.kernels.layout import align_up


def kv_page_view(kv_pool: Tensor, page_size: int, num_kv_heads: int) -> Tensor:
    """View one layer of the pool as KV pages: [num_pages, 2, page_size, num_kv_heads, head_dim]."""
    num_pages, page_elems = kv_pool.shape
    head_dim = page_elems // (2 * page_size * num_kv_heads)
    assert 2 * page_size * num_kv_heads * head_dim == page_elems, "page_elems does not match the KV shape"
    return kv_pool.view(num_pages, 2, page_size, num_kv_heads, head_dim)


def store_kv(key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor, page_size: int) -> None:
    """Write key/value `[tokens, num_kv_heads, head_dim]` into their slots of `kv_pool`. A negative
    slot (a padding token) is skipped."""
    pages = kv_page_view(kv_pool, page_size, key.shape[1])
    keep = slot_mapping >= 0  # without this, slot -1 would silently overwrite the last page
    slot_mapping = slot_mapping.long()[keep]
    page_ids, offsets = slot_mapping // page_size, slot_mapping % page_size
    pages[page_ids, 0, offsets] = key[keep].to(kv_pool.dtype)
    pages[page_ids, 1, offsets] = value[keep].to(kv_pool.dtype)


def gather_sequence_kv(kv_pool: Tensor, block_table: Tensor, length: int, page_size: int,
                       num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """K and V of the first `length` tokens of one sequence: two `[length, num_kv_heads, head_dim]`."""
    pages = kv_page_view(kv_pool, page_size, num_kv_heads)
    positions = torch.arange(length, device=kv_pool.device)
    page_ids = block_table.long()[positions // page_size]
    offsets = positions % page_size
    return pages[page_ids, 0, offsets], pages[page_ids, 1, offsets]


def _attend(query: Tensor, key: Tensor, value: Tensor, scale: float, first_position: int) -> Tensor:
    """Causal GQA attention of queries at positions first_position.. over keys at 0..len(key)-1."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    key = key.float().repeat_interleave(group, dim=1)  # [ctx, heads, head_dim]
    value = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale  # [heads, q, ctx]
    q_pos = torch.arange(query.shape[0], device=query.device)[:, None] + first_position
    k_pos = torch.arange(key.shape[0], device=query.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value).to(query.dtype)  # [q, heads, head_dim]


def paged_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, context_lens: Tensor,
                    page_size: int, num_kv_heads: int, scale: float) -> Tensor:
    """Decode attention: query `[batch, num_heads, head_dim]`, one token per sequence, attending to
    the `context_lens[b]` tokens of its block table (its own token included). Returns the same shape."""
    out = torch.empty_like(query)
    for b, length in enumerate(context_lens.tolist()):
        key, value = gather_sequence_kv(kv_pool, block_tables[b], length, page_size, num_kv_heads)
        out[b] = _attend(query[b:b + 1], key, value, scale, length - 1)[0]
    return out


def prefill_attention(query: Tensor, kv_pool: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                      context_lens: Tensor, page_size: int, num_kv_heads: int, scale: float) -> Tensor:
    """Causal attention of the new tokens of many sequences over a paged cache that may hold a prefix.

    query: `[total_new_tokens, num_heads, head_dim]`, sequence `s` owning rows
    `query_start_loc[s]:query_start_loc[s+1]`; those are the last tokens of its `context_lens[s]`
    tokens, whose K/V (prefix and new) are already in the cache."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, length in enumerate(context_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        key, value = gather_sequence_kv(kv_pool, block_tables[s], length, page_size, num_kv_heads)
        out[lo:hi] = _attend(query[lo:hi], key, value, scale, length - (hi - lo))
    return out


def gather_lora_rows(pool: Tensor, page_table: Tensor, offset: int, num_rows: int, row_len: int) -> Tensor:
    """Read `num_rows` aligned rows of `row_len` elements from an adapter's paged logical buffer."""
    page_elems = pool.shape[1]
    rows = torch.arange(num_rows, device=pool.device)[:, None] * align_up(row_len)
    elems = offset + rows + torch.arange(row_len, device=pool.device)[None, :]  # [rows, row_len]
    return pool[page_table.long()[elems // page_elems], elems % page_elems]


def lora_shrink(x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                a_offsets: Tensor, max_rank: int) -> Tensor:
    """h[t, :r] = x[t] @ A_sᵀ for s = token_slots[t] of rank r; zero elsewhere. Returns [tokens, max_rank]."""
    h = torch.zeros(x.shape[0], max_rank, dtype=x.dtype, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        rank = int(ranks[slot]) if slot >= 0 else 0
        if rank == 0:
            continue
        rows = token_slots == slot
        lora_a = gather_lora_rows(pool, page_tables[slot], int(a_offsets[slot]), rank, x.shape[1])
        h[rows, :rank] = x[rows] @ lora_a.to(x.dtype).T  # [n, rank]
    return h


def lora_expand(out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                ranks: Tensor, b_offsets: Tensor, scalings: Tensor) -> None:
    """out[t] += (h[t, :r] @ Bᵀ_s) * scaling_s for s = token_slots[t]; tokens with slot -1 untouched."""
    for slot in torch.unique(token_slots).tolist():
        rank = int(ranks[slot]) if slot >= 0 else 0
        if rank == 0:
            continue
        rows = token_slots == slot
        lora_bt = gather_lora_rows(pool, page_tables[slot], int(b_offsets[slot]), rank, out.shape[1])
        out[rows] += (h[rows, :rank] @ lora_bt.to(h.dtype)) * float(scalings[slot])  # [n, out]
