"""The Triton attention backend of a mixed step (its leading one-token rows through the decode kernel, the
rest through the prefill kernel) against the reference backend, which runs every row through the reference
prefill attention."""
import dataclasses

import pytest
import torch
from kernel_helpers import assert_close, make_generator, make_paged_kv, randn, take_new_kv

from slora.attention_backend import ReferenceAttention, TritonAttention
from slora.step_batch import StepBatch


def _batch(cases: list[tuple[int, int]], page_size: int, num_decodes: int, gen: torch.Generator,
           num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> tuple[StepBatch, torch.Tensor]:
    """A StepBatch of (cached prefix, new tokens) sequences over a random paged pool, and the pool."""
    lengths = [prefix + new for prefix, new in cases]
    kv = make_paged_kv(lengths, page_size, num_kv_heads, head_dim, dtype, gen, device)
    new = torch.tensor([n for _, n in cases])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(torch.int32)
    tokens = int(new.sum())
    zeros = torch.zeros(tokens, dtype=torch.long)
    batch = StepBatch(zeros, zeros, zeros, kv.block_tables, starts, kv.context_lens, starts[1:].long() - 1,
                      page_size, int(new.max()), max(lengths), None, num_decodes)
    return batch.to(torch.device(device)), kv.kv_pool


@pytest.mark.parametrize("cases,num_decodes", [
    ([(9, 1), (30, 1), (0, 12), (17, 5)], 2),     # two decodes, a prompt, a chunk after a prefix
    ([(40, 1), (0, 7)], 1),
    ([(5, 1), (0, 7)], 0),                        # leading decode not marked: all through the prefill kernel
    ([(0, 20), (3, 9)], 0),
])
def test_mixed_step_attention_matches_the_reference_backend(cases, num_decodes):
    gen = make_generator(len(cases) + num_decodes)
    batch, pool = _batch(cases, 8, num_decodes, gen, num_kv_heads=2, head_dim=16)
    tokens = batch.input_ids.shape[0]
    query = randn((tokens, 4, 16), torch.float32, gen)
    want = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    # The step's own keys and values, taken out of the pool (NaN there now, but for the decode rows, whose
    # kernel reads its own token from the pool): the Triton backend reads them from new_kv, and prefixes
    # and the decode rows' contexts from the pool.
    new_kv = take_new_kv(pool, batch.block_tables, cases, 8, 2, keep_first=num_decodes)
    got = TritonAttention(new_kv_min_tokens=1).attend(query, new_kv, pool, batch, 2, 0.25)
    assert_close(got, want)


def test_a_step_below_new_kv_min_tokens_reads_its_keys_back_from_the_pages():
    """Fewer prefill tokens than new_kv_min_tokens: the step's keys and values come from the pool (new_kv
    NaN here), and at the threshold from new_kv (the pool's copies NaN)."""
    cases = [(9, 1), (0, 12), (17, 5)]
    gen = make_generator(11)
    batch, pool = _batch(cases, 8, 1, gen, num_kv_heads=2, head_dim=16)
    query = randn((18, 4, 16), torch.float32, gen)
    want = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    nan_rows = torch.full((18, 2, 16), float("nan"))
    below = TritonAttention(new_kv_min_tokens=18).attend(query, (nan_rows, nan_rows), pool, batch, 2, 0.25)
    assert_close(below, want)
    new_kv = take_new_kv(pool, batch.block_tables, cases, 8, 2, keep_first=1)
    at = TritonAttention(new_kv_min_tokens=17).attend(query, new_kv, pool, batch, 2, 0.25)
    assert_close(at, want)


def test_new_kv_min_tokens_must_not_be_negative():
    with pytest.raises(ValueError, match="new_kv_min_tokens must be >= 0"):
        TritonAttention(new_kv_min_tokens=-1)


@pytest.mark.parametrize("cases,num_decodes", [
    ([(9, 1), (30, 1), (0, 12), (17, 5)], 2),
    ([(0, 20), (3, 9)], 0),                       # no decode rows: the decode kernel's rows all empty
    ([(5, 1), (0, 7), (11, 1)], 1),               # a one-token row after the first prefill row
])
def test_attention_in_a_bucket_graph_reads_only_the_steps_rows(cases, num_decodes):
    """A bucket's graph (slora.mixed_graphs) launches attention over the bucket's tokens and sequences, not
    the step's: the rows and sequences past the step hold stale tables and NaN queries. The step's rows
    match the reference; the bucket's first `seqs` rows past them get zeros, the rest keep `out`'s zeros."""
    from slora.mixed_graphs import attention_inputs

    gen = make_generator(20 + len(cases))
    batch, pool = _batch(cases, 8, num_decodes, gen, num_kv_heads=2, head_dim=16)
    tokens, count = batch.input_ids.shape[0], len(cases)
    query = randn((tokens, 4, 16), torch.float32, gen)
    want = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    # More sequence slots than the step has tokens (as a 16-token bucket for a 10-token step): rows past the
    # step reach the decode kernel, whose stale context lengths (40 here) it must not read.
    bucket_tokens, seqs = tokens + 13, tokens + 2
    padded_query = torch.cat([query, torch.full((bucket_tokens - tokens, 4, 16), float("nan"))])
    stale = torch.randint(1, pool.shape[0], (seqs - count, batch.block_tables.shape[1]), generator=gen,
                          dtype=torch.int32)
    bucket = dataclasses.replace(batch, block_tables=torch.cat([batch.block_tables, stale]),
                                 context_lens=torch.cat([batch.context_lens, torch.full((seqs - count,), 40,
                                                                                        dtype=torch.int32)]))
    inputs = attention_inputs(batch, seqs)
    out = torch.zeros_like(padded_query)
    got = TritonAttention().attend_in_graph(padded_query, pool, bucket, inputs, 2, 0.25, out)
    assert got is out
    assert_close(got[:tokens], want)
    assert got[tokens:].eq(0).all()


def _varlen_causal(query, key, value, starts, longest, scale):
    """Causal attention of sequences over their own rows, per sequence through torch SDPA: the stand-in for
    FlashAttention-2 (CUDA only) on the CPU, checking the arguments the backend gives it."""
    assert starts[0] == 0 and starts[-1] == query.shape[0] and longest >= int((starts[1:] - starts[:-1]).max())
    group = query.shape[1] // key.shape[1]
    out = []
    for begin, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
        q, k, v = (t[begin:end].transpose(0, 1) for t in (query, key, value))      # [heads, rows, head_dim]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), is_causal=True,
            scale=scale).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("cases,num_decodes,fresh_seqs", [
    ([(9, 1), (30, 1), (0, 12), (0, 5)], 2, 2),           # decodes beside prompts from position 0
    ([(9, 1), (30, 1), (17, 5), (0, 12), (0, 5)], 2, 2),  # and a chunk after an earlier one
    ([(0, 20), (0, 9), (0, 1)], 0, 3),                    # prompts alone: the flash output is the step's
    ([(4, 20), (0, 9), (0, 1)], 0, 1),                    # a cached prefix, then the trailing prompts
])
def test_trailing_fresh_prompts_attend_through_flash_and_the_other_rows_through_triton(
        cases, num_decodes, fresh_seqs, monkeypatch):
    from slora import attention_backend

    calls = []
    monkeypatch.setattr(attention_backend, "_FLASH_DTYPES", (torch.float32,))
    monkeypatch.setattr(attention_backend, "_fresh_flash_attention",
                        lambda *args: calls.append(args[3].tolist()) or _varlen_causal(*args))
    gen = make_generator(30 + len(cases))
    batch, pool = _batch(cases, 8, num_decodes, gen, num_kv_heads=2, head_dim=16)
    tokens = batch.input_ids.shape[0]
    query = randn((tokens, 4, 16), torch.float32, gen)
    want = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    # The prompts' K/V only in new_kv (NaN in the pool): flash reads them there.
    new_kv = take_new_kv(pool, batch.block_tables, cases, 8, 2, keep_first=num_decodes)
    rows = [n for _, n in cases[len(cases) - fresh_seqs:]]
    fresh = dataclasses.replace(batch, fresh_seqs=fresh_seqs, fresh_tokens=sum(rows))
    got = TritonAttention(new_kv_min_tokens=1, flash_prefill=True).attend(query, new_kv, pool, fresh, 2, 0.25)
    assert_close(got, want)
    assert calls == [[sum(rows[:i]) for i in range(len(rows) + 1)]]     # each prompt's rows, from 0


def test_flash_is_not_used_for_a_step_without_fresh_prompts_or_when_switched_off(monkeypatch):
    from slora import attention_backend

    monkeypatch.setattr(attention_backend, "_FLASH_DTYPES", (torch.float32,))
    monkeypatch.setattr(attention_backend, "_fresh_flash_attention", lambda *args: pytest.fail("flash ran"))
    cases = [(9, 1), (0, 12), (17, 5)]
    gen = make_generator(40)
    batch, pool = _batch(cases, 8, 1, gen, num_kv_heads=2, head_dim=16)
    query = randn((18, 4, 16), torch.float32, gen)
    want = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    new_kv = take_new_kv(pool, batch.block_tables, cases, 8, 2, keep_first=1)
    assert_close(TritonAttention(new_kv_min_tokens=1, flash_prefill=True).attend(query, new_kv, pool, batch, 2, 0.25),
                 want)
    fresh = dataclasses.replace(batch, fresh_seqs=1, fresh_tokens=5)
    assert_close(TritonAttention(new_kv_min_tokens=1).attend(query, new_kv, pool, fresh, 2, 0.25), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_decodes", [0, 3])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_of_a_fresh_step_matches_the_triton_kernel_on_cuda(dtype, num_decodes):
    """FlashAttention-2 over Llama-8B's heads (32 query, 8 KV heads of 128), queries and keys views of one
    fused q/k/v output as in the model, prompts of uneven lengths (one of a single token), after a chunk
    with a cached prefix, decodes beside."""
    from slora.attention_backend import flash_supported

    if not flash_supported(torch.device("cuda")):
        pytest.skip("torch's FlashAttention-2 does not run on this GPU")
    cases = [(300, 1), (41, 1), (7, 1)][:num_decodes] + [(33, 100), (0, 700), (0, 1), (0, 129), (0, 1024)]
    gen = make_generator(50 + num_decodes)
    batch, pool = _batch(cases, 16, num_decodes, gen, num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda")
    tokens = batch.input_ids.shape[0]
    qkv = randn((tokens, (32 + 16) * 128), dtype, gen).cuda()
    query = qkv[:, :32 * 128].view(tokens, 32, 128)                            # [tokens, heads, head_dim]
    new_kv = take_new_kv(pool, batch.block_tables, cases, 16, 8, keep_first=num_decodes)
    key = qkv[:, 32 * 128:40 * 128].view(tokens, 8, 128)
    key.copy_(new_kv[0])
    fresh = dataclasses.replace(batch, fresh_seqs=4, fresh_tokens=700 + 1 + 129 + 1024)
    triton_kernel = TritonAttention(new_kv_min_tokens=1).attend(query, (key, new_kv[1]), pool, fresh, 8, 0.088)
    flash = TritonAttention(flash_prefill=True).attend(query, (key, new_kv[1]), pool, fresh, 8, 0.088)
    assert_close(flash, triton_kernel)
