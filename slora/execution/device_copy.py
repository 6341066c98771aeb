"""Host-to-device copies that never make the host wait for the GPU.

A copy from pageable host memory first waits for every kernel queued on the stream (CUDA stages pageable
memory only once the stream is idle), so under overlapped scheduling a plain `tensor.to("cuda")` would hold
the host until the forward it should be overlapping ends. From pinned memory the copy is only queued. The
caching host allocator keeps each pinned block until the copy that reads it has run.
"""
from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`, without waiting for the GPU when it goes from the host to CUDA."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_on(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without waiting for the GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_from_host(target: Tensor, source: Tensor) -> None:
    """`target.copy_(source)` for a host `source`, without waiting for the GPU when `target` is on CUDA."""
    if target.device.type == "cuda" and source.device.type == "cpu":
        source = source.pin_memory()
    target.copy_(source, non_blocking=True)


def _leading(rows: list[int]) -> bool:
    """Whether the rows are 0, 1, 2, ... in order: then a slice stands for them, with no index to copy."""
    return rows == list(range(len(rows)))


def select_rows(tensor: Tensor, rows: list[int]) -> Tensor:
    """`tensor[rows]` without waiting for the GPU (a list index is copied from pageable memory): a slice when
    the rows are the leading ones in order, the common case."""
    if _leading(rows):
        return tensor[:len(rows)]
    return tensor.index_select(0, tensor_on(rows, torch.int64, tensor.device))


def write_rows(tensor: Tensor, rows: list[int], values: Tensor) -> None:
    """`tensor[rows] = values` without waiting for the GPU, a slice copy when the rows lead (select_rows)."""
    if _leading(rows):
        tensor[:len(rows)].copy_(values)
    else:
        tensor.index_copy_(0, tensor_on(rows, torch.int64, tensor.device), values)
