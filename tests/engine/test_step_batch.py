"""StepBatch's derived copies: the graphs' static buffers, their views and the copy of a step into them."""
import dataclasses

import numpy as np
import pytest
import torch

from slora.execution import step_batch

LARGEST = {"tokens": 8, "seqs": 8, "pages": 4, "slots": 8, "adapter_pages": 3, "layers": 2, "modules": 7}


def _step(n: int, slots: int, width: int) -> step_batch.HostBatch:
    """A decode step of n sequences over `slots` adapters, every value distinct from any pad value."""
    tables = torch.arange(2 * 7 * slots).view(2, 7, slots) + 1                     # [layers, modules, slots]
    lora = step_batch.StepLora(
        token_slots=torch.arange(n, dtype=torch.int32) % slots, page_tables=torch.full((slots, 2), 5, dtype=torch.int32),
        ranks=tables.int(), a_offsets=tables.long(), b_offsets=tables.long(), scalings=tables.float(), max_rank=16,
        active=[[True] * 7] * 2)
    return step_batch.as_host(step_batch.StepBatch(
        input_ids=torch.arange(n) + 100, positions=torch.arange(n) + 200, kv_locations=torch.arange(n) + 300,
        block_tables=torch.full((n, width), 7, dtype=torch.int32), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        context_lens=torch.arange(n, dtype=torch.int32) + 1, sample_indices=torch.arange(n), page_size=16,
        max_query_len=1, max_context_len=width * 16, lora=lora))


def _dirty(batch: step_batch.StepBatch) -> None:
    """Leftovers of an earlier, larger step in every buffer but the arange ones."""
    for tensor in (batch.input_ids, batch.positions, batch.kv_locations, batch.block_tables, batch.context_lens):
        tensor.fill_(9)
    assert batch.lora is not None
    for tensor in (batch.lora.token_slots, batch.lora.page_tables, batch.lora.ranks, batch.lora.a_offsets):
        tensor.fill_(9)


def test_empty_makes_buffers_of_the_named_sizes_with_pads_and_aranges():
    static = step_batch.empty(LARGEST, torch.device("cpu"), page_size=16, max_rank=32)
    assert static.block_tables.shape == (8, 4) and static.query_start_loc.shape == (9,)
    assert torch.equal(static.query_start_loc, torch.arange(9, dtype=torch.int32))
    assert torch.equal(static.sample_indices, torch.arange(8))
    assert (static.kv_locations == -1).all() and (static.context_lens == 0).all()
    assert static.lora is not None and static.lora.ranks.shape == (2, 7, 8) and (static.lora.token_slots == -1).all()
    assert static.max_context_len == 4 * 16 and static.lora.max_rank == 32


def test_copy_into_a_view_pads_what_the_step_leaves_and_keeps_the_aranges():
    static = step_batch.empty(LARGEST, torch.device("cpu"), page_size=16, max_rank=32)
    _dirty(static)
    graph = step_batch.view(static, {**LARGEST, "tokens": 4, "seqs": 4, "slots": 4}, with_lora=True)
    assert graph.input_ids.shape == (4,) and graph.block_tables.shape == (4, 4) and graph.query_start_loc.shape == (5,)
    assert graph.input_ids.data_ptr() == static.input_ids.data_ptr()          # views of the static buffers
    host = _step(n=3, slots=2, width=2)
    host.copy_into(step_batch.host_arrays(graph))
    assert graph.input_ids[:3].tolist() == [100, 101, 102] and graph.positions[:3].tolist() == [200, 201, 202]
    assert graph.kv_locations.tolist() == [300, 301, 302, -1]                 # padding rows store no K/V
    assert graph.context_lens.tolist() == [1, 2, 3, 0]                         # and attend to nothing
    assert graph.block_tables[:3, :2].tolist() == [[7, 7]] * 3
    assert torch.equal(graph.query_start_loc, torch.arange(5, dtype=torch.int32))   # never copied into
    lora, want = graph.lora, host.lora
    assert lora is not None and want is not None
    assert lora.token_slots.tolist() == [0, 1, 0, -1]
    assert np.array_equal(lora.ranks[:, :, :2], want.ranks) and (lora.ranks[:, :, 2:] == 0).all()   # no weight read
    assert np.array_equal(lora.a_offsets[:, :, :2], want.a_offsets)
    assert np.array_equal(lora.page_tables[:2, :2], want.page_tables)


def test_to_moves_every_tensor_and_a_view_without_lora_has_none():
    host = _step(n=2, slots=1, width=1)
    moved = host.to(torch.device("cpu"))
    assert moved is not host and moved.lora is not None and host.lora is not None
    assert moved.input_ids.tolist() == [100, 101] and moved.lora.ranks.tolist() == host.lora.ranks.tolist()
    static = step_batch.empty(LARGEST, torch.device("cpu"), page_size=16, max_rank=16)
    for name, tensor in step_batch.tensors_of(moved).items():     # each field a tensor of its declared dtype
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == step_batch.tensors_of(static)[name].dtype, name
    with pytest.raises(AssertionError, match="host field positions is torch.int32"):
        dataclasses.replace(host, positions=host.positions.astype(np.int32)).to(torch.device("cpu"))
    base = step_batch.view(static, {"tokens": 2, "seqs": 2}, with_lora=False)
    assert base.lora is None and base.block_tables.shape == (2, 4)            # unnamed dims stay whole


def test_build_lays_out_decode_rows_prompt_rows_and_a_chunk():
    """A decode row (its last output token), a one-token item of a prompt (a chunk that ends it) and a
    three-token chunk in the middle of a prompt: ids, positions, slots through the block tables, sampled rows."""
    from slora.core.scheduler import ScheduledSeq
    from slora.core.sequence import BlockTable, Sequence
    from slora.sampling.params import SamplingParams

    def seq(prompt: list[int], output: list[int], computed: int, table: list[int]) -> Sequence:
        s = Sequence(1, "r", prompt, SamplingParams(max_tokens=8), output_token_ids=output,
                     block_table=BlockTable(table))
        s.num_computed_tokens = computed
        return s
    decoding = seq([11, 12, 13, 14], [21, 22], computed=5, table=[3, 7])      # position 5: page 7, offset 1
    ending = seq([31, 32, 33, 34, 35], [], computed=4, table=[2, 9])          # position 4: page 9, offset 0
    middle = seq([41, 42, 43, 44, 45, 46], [], computed=1, table=[5, 6])      # positions 1-3 of page 5
    batch = step_batch.build([ScheduledSeq(decoding, 1), ScheduledSeq(ending, 1), ScheduledSeq(middle, 3)], {}, 4)
    assert batch.input_ids.tolist() == [22, 35, 42, 43, 44]
    assert batch.positions.tolist() == [5, 4, 1, 2, 3]
    assert batch.kv_locations.tolist() == [7 * 4 + 1, 9 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3]
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5] and batch.context_lens.tolist() == [6, 5, 4]
    assert batch.sample_indices.tolist() == [0, 1]                 # the middle chunk samples nothing
    assert batch.num_decodes == 2                                  # the leading one-token rows
    assert step_batch.build([ScheduledSeq(middle, 3), ScheduledSeq(decoding, 1)], {}, 4).num_decodes == 0


def test_build_gives_a_chunk_across_pages_each_pages_slots_and_pads_ragged_tables():
    """A nine-token chunk over three pages takes each page's run of slots; block tables of unequal widths
    are zero-padded to the widest; every token of a sequence takes its adapter's slot, -1 without one."""
    from slora.adapters.packing import AdapterDescriptor
    from slora.core.scheduler import ScheduledSeq
    from slora.core.sequence import AdapterRef, BlockTable, Sequence
    from slora.sampling.params import SamplingParams

    decoding = Sequence(1, "d", [1, 2, 3], SamplingParams(max_tokens=8), output_token_ids=[7],
                        block_table=BlockTable([8]))
    decoding.num_computed_tokens = 3                                          # position 3: page 8, offset 3
    chunked = Sequence(2, "c", list(range(100, 112)), SamplingParams(max_tokens=8),
                       block_table=BlockTable([5, 9, 4]), adapter=AdapterRef("v1", 2))
    chunked.num_computed_tokens = 2                                           # positions 2-10
    tables = torch.ones(2, 7, dtype=torch.int32)
    descriptor = AdapterDescriptor(tables * 8, tables.long(), tables.long(), tables.float())
    batch = step_batch.build([ScheduledSeq(decoding, 1), ScheduledSeq(chunked, 9)], {"v1": (descriptor, [11, 12])}, 4)
    assert batch.input_ids.tolist() == [7, *range(102, 111)]
    assert batch.kv_locations.tolist() == [8 * 4 + 3, 5 * 4 + 2, 5 * 4 + 3, *range(9 * 4, 9 * 4 + 4), *range(4 * 4, 4 * 4 + 3)]
    assert batch.block_tables.tolist() == [[8, 0, 0], [5, 9, 4]]
    assert batch.lora is not None and batch.lora.token_slots.tolist() == [-1] + [0] * 9
    assert batch.lora.page_tables.tolist() == [[11, 12]] and batch.lora.token_slots.dtype == np.int32


def test_a_block_table_grows_reads_and_writes_pages_like_a_list():
    """Pages appended past the array's capacity keep the earlier ones; reads and writes, negative indices
    too, act on the list and the array alike; an index past the table raises, even where the array has
    room; `pages` is the table's length."""
    from slora.core.sequence import BlockTable

    table = BlockTable([4, 9])
    for chunk in ([1], [2, 3, 5], list(range(10, 30)), [7]):       # the last leaves room in the array
        table.extend(chunk)
    want = [4, 9, 1, 2, 3, 5, *range(10, 30), 7]
    assert len(table) == len(want) and table.tolist() == want and list(table) == want
    assert table.pages.dtype == np.int32 and table.pages.tolist() == want
    table[1] = 77
    table[-1] = 78
    want[1], want[-1] = 77, 78
    assert table[1] == 77 and table[-1] == 78 and table.pages.tolist() == want and table.tolist() == want
    with pytest.raises(IndexError):
        table[len(want)]
    with pytest.raises(IndexError):
        table[len(want)] = 3
    with pytest.raises(TypeError):
        table[0:2] = [1, 2]                                   # a slice would reach the list alone
    assert table.pages.tolist() == want and table == want and table == BlockTable(want) and table != want[:-1]
    assert len(BlockTable()) == 0 and BlockTable().tolist() == [] and BlockTable().pages.shape == (0,)


def test_a_recomputed_chunk_reads_its_prompt_and_output_tokens_in_order():
    """After a preemption a sequence's chunk may run past its prompt into its output: its ids are the
    prompt's then the output's, between the decode rows' and the next run's."""
    from slora.core.scheduler import ScheduledSeq
    from slora.core.sequence import BlockTable, Sequence
    from slora.sampling.params import SamplingParams

    recomputed = Sequence(1, "p", [1, 2, 3], SamplingParams(max_tokens=8), output_token_ids=[7, 8],
                          block_table=BlockTable([4, 5]))
    decoding = Sequence(2, "d", [11, 12], SamplingParams(max_tokens=8), output_token_ids=[13],
                        block_table=BlockTable([6]))
    decoding.num_computed_tokens = 2
    assert recomputed.token_array(1, 3).tolist() == [2, 3] and recomputed.token_array(2, 5).tolist() == [3, 7, 8]
    batch = step_batch.build([ScheduledSeq(decoding, 1), ScheduledSeq(recomputed, 4), ScheduledSeq(decoding, 1)],
                             {}, 4)
    assert batch.input_ids.tolist() == [13, 1, 2, 3, 7, 13] and batch.input_ids.dtype == np.int64
    assert batch.positions.tolist() == [2, 0, 1, 2, 3, 2]
    assert batch.kv_locations.tolist() == [6 * 4 + 2, 4 * 4, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 2]


def test_a_build_refuses_a_token_past_its_block_table():
    """A row whose table lacks the page of one of its positions would read the padding, page 0, which
    belongs to another sequence: the build stops there. The prompt's array is read-only."""
    from slora.core.scheduler import ScheduledSeq
    from slora.core.sequence import BlockTable, Sequence
    from slora.sampling.params import SamplingParams

    short = Sequence(1, "s", list(range(10)), SamplingParams(max_tokens=8), block_table=BlockTable([3]))
    longer = Sequence(2, "l", list(range(10)), SamplingParams(max_tokens=8), block_table=BlockTable([4, 5, 6]))
    with pytest.raises(AssertionError, match="without its page"):
        step_batch.build([ScheduledSeq(longer, 10), ScheduledSeq(short, 6)], {}, 4)   # positions 4-5: page 1
    assert step_batch.build([ScheduledSeq(longer, 10), ScheduledSeq(short, 4)], {}, 4).kv_locations[-1] == 3 * 4 + 3
    with pytest.raises(ValueError):
        short.prompt_array[0] = 9
