"""The Triton attention backend of a mixed step (its leading one-token rows through the decode kernel, the
rest through the prefill kernel) against the reference backend, which runs every row through the reference
prefill attention."""
import dataclasses

import pytest
import torch
from kernel_helpers import assert_close, make_generator, make_paged_kv, randn, take_new_kv

from slora.execution import step_batch
from slora.execution.attention_backend import ReferenceAttention, TritonAttention, row_queries
from slora.execution.step_batch import StepBatch
from slora.kernels.reference import KVCache


def _batch(cases: list[tuple[int, int]], page_size: int, num_decodes: int, gen: torch.Generator,
           num_kv_heads: int, head_dim: int) -> tuple[StepBatch, KVCache]:
    """A StepBatch of (cached prefix, new tokens) sequences over a random paged pool, and the pool."""
    lengths = [prefix + new for prefix, new in cases]
    kv = make_paged_kv(lengths, page_size, num_kv_heads, head_dim, torch.float32, gen)
    new = torch.tensor([n for _, n in cases])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(torch.int32)
    tokens = int(new.sum())
    zeros = torch.zeros(tokens, dtype=torch.long)
    batch = StepBatch(input_ids=zeros, positions=zeros, kv_locations=zeros, block_tables=kv.block_tables,
                      query_start_loc=starts, context_lens=kv.context_lens, sample_indices=starts[1:].long() - 1,
                      page_size=page_size, max_query_len=int(new.max()), max_context_len=max(lengths),
                      num_decodes=num_decodes)
    return batch, KVCache(kv.kv_pool)


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
    new_kv = take_new_kv(pool.pages, batch.block_tables, cases, 8, 2, keep_first=num_decodes)
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
    new_kv = take_new_kv(pool.pages, batch.block_tables, cases, 8, 2, keep_first=1)
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
    """A bucket's graph (slora.execution.mixed_graphs) launches attention over the bucket's tokens and sequences, not
    the step's: the rows and sequences past the step hold stale tables and NaN queries. The step's rows
    match the reference; the bucket's first `seqs` rows past them get zeros, the rest keep `out`'s zeros."""
    from slora.execution.mixed_graphs import attention_inputs

    gen = make_generator(20 + len(cases))
    batch, pool = _batch(cases, 8, num_decodes, gen, num_kv_heads=2, head_dim=16)
    tokens, count = batch.input_ids.shape[0], len(cases)
    query = randn((tokens, 4, 16), torch.float32, gen)
    want = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    # More sequence slots than the step has tokens (as a 16-token bucket for a 10-token step): rows past the
    # step reach the decode kernel, whose stale context lengths (40 here) it must not read.
    bucket_tokens, seqs = tokens + 13, tokens + 2
    padded_query = torch.cat([query, torch.full((bucket_tokens - tokens, 4, 16), float("nan"))])
    stale = torch.randint(1, pool.pages.shape[0], (seqs - count, batch.block_tables.shape[1]), generator=gen,
                          dtype=torch.int32)
    bucket = dataclasses.replace(batch, block_tables=torch.cat([batch.block_tables, stale]),
                                 context_lens=torch.cat([batch.context_lens, torch.full((seqs - count,), 40,
                                                                                        dtype=torch.int32)]))
    on_host = step_batch.with_tensors(batch, {name: t.cpu() for name, t in step_batch.tensors_of(batch).items()})
    inputs = attention_inputs(step_batch.as_host(on_host), seqs)
    out = torch.zeros_like(padded_query)
    got = TritonAttention().attend_in_graph(padded_query, pool, bucket, inputs, 2, 0.25, out)
    assert got is out
    assert_close(got[:tokens], want)
    assert got[tokens:].eq(0).all()


def _with_positions(batch: StepBatch, cases: list[tuple[int, int]]) -> StepBatch:
    """The batch with each token's position (its prefix, then its new tokens)."""
    positions = torch.cat([torch.arange(prefix, prefix + new) for prefix, new in cases])
    return dataclasses.replace(batch, positions=positions)


@pytest.mark.parametrize("cases,rows", [
    ([(9, 1), (30, 1), (0, 12), (17, 5)], [0, 1, 13, 18]),   # two decodes, then each prompt's last row
    ([(0, 20), (3, 9)], [19, 28]),
    ([(0, 20), (3, 9)], [4, 21, 19]),                      # rows inside a prompt, out of order
    ([(40, 1), (0, 7)], []),                               # no row (a chunk step that samples nothing)
])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_of_some_rows_matches_the_whole_steps(cases, rows, backend):
    """The last layer attends only its sampled rows, each as a decode query over its sequence's pages up to
    its own position: the same as those rows of the whole step's attention (every K/V in the pool)."""
    gen = make_generator(30 + len(rows))
    batch, pool = _batch(cases, 8, 0, gen, num_kv_heads=2, head_dim=16)
    batch = _with_positions(batch, cases)
    tokens = batch.input_ids.shape[0]
    query = randn((tokens, 4, 16), torch.float32, gen)
    whole = ReferenceAttention().attend(query, (query[:, :2], query[:, :2]), pool, batch, 2, 0.25)
    index = torch.tensor(rows, dtype=torch.long)
    attention = ReferenceAttention() if backend == "reference" else TritonAttention()
    got = attention.attend_rows(query[index], pool, row_queries(batch, index), 8, 2, 0.25)
    assert got.shape == (len(rows), 4, 16)
    assert_close(got, whole[index])


def test_row_queries_find_each_rows_sequence_past_empty_ones():
    """Sequences that start at one row (empty ones, as a bucket's padding): the row is the last one's, and its
    context ends at its own position."""
    tables = torch.arange(12, dtype=torch.int32).view(4, 3)
    starts = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int32)       # sequence 1 is empty; 3 and the end too
    positions = torch.tensor([5, 6, 7, 0, 1, 2, 3])
    batch = StepBatch(input_ids=positions, positions=positions, kv_locations=positions, block_tables=tables,
                      query_start_loc=starts, context_lens=torch.tensor([8, 0, 4, 0], dtype=torch.int32),
                      sample_indices=torch.tensor([2, 3, 6]), page_size=8, max_query_len=4, max_context_len=8)
    got_rows, got_tables, context_lens = row_queries(batch, torch.tensor([2, 3, 6]))
    assert got_rows.tolist() == [2, 3, 6]
    assert got_tables.tolist() == [tables[0].tolist(), tables[2].tolist(), tables[2].tolist()]
    assert context_lens.tolist() == [8, 1, 4] and context_lens.dtype == torch.int32
