"""The graphs' staged inputs (slora.execution.staging): one byte buffer's named views, filled from two host twins in
turn. On the CPU the 'device' buffer is a host tensor; the GPU e2e tests replay graphs through it."""
import torch

from slora.execution import step_batch
from slora.execution.staging import REGION_ALIGN, StagedBatch, StagedBuffers

CPU = torch.device("cpu")


def _initial() -> dict[str, torch.Tensor]:
    return {"odd": torch.arange(3, dtype=torch.int32), "wide": torch.arange(4, dtype=torch.int64) + 10,
            "table": torch.full((2, 3), 0.5)}


def test_every_view_starts_with_its_initial_value_on_an_aligned_offset():
    buffers = StagedBuffers(_initial(), CPU)
    for tensors in (buffers.device_tensors, *buffers.twin_tensors):
        for name, want in _initial().items():
            got = tensors[name]
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert got.data_ptr() % REGION_ALIGN == tensors["odd"].data_ptr() % REGION_ALIGN


def test_a_step_written_into_the_current_twin_reaches_the_device_on_send_only():
    buffers = StagedBuffers(_initial(), CPU)
    twin = buffers.begin()
    buffers.twin_tensors[twin]["wide"][:2] = torch.tensor([7, 8])
    assert buffers.device_tensors["wide"].tolist() == [10, 11, 12, 13]          # not sent yet
    buffers.send()
    assert buffers.device_tensors["wide"].tolist() == [7, 8, 12, 13]
    assert torch.equal(buffers.device_tensors["table"], _initial()["table"])   # the rest sent as it was


def test_the_twins_take_turns_and_each_keeps_what_was_last_written_into_it():
    buffers = StagedBuffers(_initial(), CPU)
    turns = []
    for value in (1, 2, 3):
        twin = buffers.begin()
        turns.append(twin)
        buffers.twin_tensors[twin]["odd"].fill_(value)
        buffers.send()
        assert buffers.device_tensors["odd"].tolist() == [value] * 3
    assert turns == [0, 1, 0]
    assert buffers.twin_tensors[1]["odd"].tolist() == [2] * 3                    # not written over by the third


def test_a_staged_batch_views_the_same_fields_on_the_device_and_in_each_twin():
    sizes = {"tokens": 8, "seqs": 4, "pages": 3, "slots": 2, "adapter_pages": 2, "layers": 2, "modules": 7}
    staged = StagedBatch(step_batch.empty(sizes, CPU, page_size=16, max_rank=16), CPU)
    views = staged.views({**sizes, "tokens": 2, "seqs": 2}, with_lora=True)
    assert views.device.input_ids.shape == (2,) and views.device.block_tables.shape == (2, 3)
    assert views.device.lora is not None and (views.device.lora.token_slots == -1).all()
    assert views.device.query_start_loc.tolist() == [0, 1, 2]                  # the aranges, sent at start
    twin = staged.begin(views).batch
    assert twin is views.twins[0] and twin["input_ids"].ctypes.data != views.device.input_ids.data_ptr()
    assert twin["block_tables"].shape == (2, 3) and (twin["token_slots"] == -1).all()
    twin["positions"][:] = [5, 6]
    staged.send()
    assert views.device.positions.tolist() == [5, 6]
    assert staged.begin(views).batch is views.twins[1]


def test_a_twins_extra_tensor_is_a_numpy_view_that_send_carries_to_the_device():
    sizes = {"tokens": 4, "seqs": 2, "pages": 2, "slots": 1, "adapter_pages": 1, "layers": 1, "modules": 7}
    staged = StagedBatch(step_batch.empty(sizes, CPU, page_size=16, max_rank=16), CPU,
                         {"extra": torch.zeros(5, dtype=torch.int32)})
    views = staged.views(sizes, with_lora=False)
    twin = staged.begin(views)
    assert "token_slots" not in twin.batch                                      # a view without LoRA
    twin.extras["extra"][:3] = [4, 5, 6]
    staged.send()
    assert staged.device_extra("extra").tolist() == [4, 5, 6, 0, 0]
    assert staged.begin(views).extras["extra"].tolist() == [0] * 5               # the other twin, untouched
