"""What tensor-parallel rank 0 tells the other ranks (DESIGN §10): a command, a few ints and some arrays, never
a Python object. One fixed-size header says how many of each and the arrays' dtypes and shapes; then one
payload holds every array's bytes. All of it goes over a CPU (gloo) group, apart from the collectives of the
forward; a step's sampled ids, which stay on the device, go over the device group."""
import enum
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from slora.execution.tensor_parallel import TensorParallelError

# Dtypes an array may have, by their code in the header.
_DTYPES = (torch.int64, torch.int32, torch.float32, torch.bool, torch.float16, torch.bfloat16, torch.uint8)
MAX_INTS, MAX_ARRAYS, MAX_DIMS = 16, 32, 3
_ARRAY_FIELDS = 2 + MAX_DIMS                     # dtype code, ndim, dims
_HEADER = 3 + MAX_INTS + MAX_ARRAYS * _ARRAY_FIELDS


class Command(enum.IntEnum):
    STOP = 0
    MOVE_PAGES = 1      # swaps, copy-on-write copies and adapter loads: page ids (and each rank's adapter part)
    STEP = 2            # one forward: the step's host batch, and its token feed


class Message(NamedTuple):
    command: Command
    ints: list[int]
    arrays: list[Tensor]          # on the CPU


class StepChannel:
    """Rank 0 sends, every other rank receives, in the same order. `group`: the CPU group the messages go over
    (None: the default group); `device_group`: the group of the device's collectives (None: the default)."""

    def __init__(self, group: dist.ProcessGroup | None = None, device_group: dist.ProcessGroup | None = None) -> None:
        self.group, self.device_group = group, device_group

    def send(self, command: Command, ints: Sequence[int] = (), arrays: Sequence[np.ndarray | Tensor] = ()) -> None:
        """Two broadcasts whatever the arrays: the header, then every array's bytes in one payload. A step of
        fifteen arrays took 4.3-5.4 ms over gloo on the 2-core CPU machine sent one array at a time, 0.9-1.2 ms
        as one payload."""
        tensors = [torch.as_tensor(array).contiguous() for array in arrays]
        header = _header(command, ints, tensors)
        payload = torch.zeros(sum(_padded_bytes(t.dtype, t.shape) for t in tensors), dtype=torch.uint8)
        for tensor, chunk in zip(tensors, _chunks(payload, [(t.dtype, list(t.shape)) for t in tensors])):
            chunk.copy_(tensor)
        with _failures_named("sending a command"):
            dist.broadcast(header, src=0, group=self.group)
            if payload.numel():
                dist.broadcast(payload, src=0, group=self.group)

    def receive(self) -> Message:
        header = torch.empty(_HEADER, dtype=torch.int64)
        with _failures_named("waiting for rank 0's next command"):
            dist.broadcast(header, src=0, group=self.group)
            command, num_ints, num_arrays = (int(v) for v in header[:3])
            specs = _array_specs(header, num_arrays)
            payload = torch.empty(sum(_padded_bytes(dtype, shape) for dtype, shape in specs), dtype=torch.uint8)
            if payload.numel():
                dist.broadcast(payload, src=0, group=self.group)
        return Message(Command(command), header[3:3 + num_ints].tolist(), _chunks(payload, specs))

    def broadcast_device(self, tensor: Tensor) -> Tensor:
        """A device tensor from rank 0 to every rank (in place; the others pass one of its shape)."""
        with _failures_named("sending the sampled ids"):
            dist.broadcast(tensor, src=0, group=self.device_group)
        return tensor

    def send_to(self, rank: int, tensor: Tensor) -> None:
        """A CPU tensor from rank 0 to one rank (its part of an adapter)."""
        with _failures_named(f"sending rank {rank} its part of an adapter"):
            dist.send(tensor.contiguous(), dst=rank, group=self.group)

    def receive_into(self, tensor: Tensor) -> Tensor:
        with _failures_named("receiving this rank's part of an adapter"):
            dist.recv(tensor, src=0, group=self.group)
        return tensor

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (the pool's pages: every rank holds as many)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        with _failures_named("agreeing on the pool's size"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor)


def _header(command: Command, ints: Sequence[int], tensors: list[Tensor]) -> Tensor:
    assert len(ints) <= MAX_INTS and len(tensors) <= MAX_ARRAYS, "a command of more fields than the header holds"
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[:3] = torch.tensor([int(command), len(ints), len(tensors)])
    header[3:3 + len(ints)] = torch.tensor(list(ints), dtype=torch.int64)
    for i, tensor in enumerate(tensors):
        assert tensor.dim() <= MAX_DIMS, "an array of more dimensions than the header holds"
        start = 3 + MAX_INTS + i * _ARRAY_FIELDS
        header[start:start + 2 + tensor.dim()] = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(),
                                                               *tensor.shape])
    return header


def _padded_bytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """An array's bytes in a payload, rounded up to 8 so that every array starts aligned for its dtype."""
    return -(-math.prod(shape) * dtype.itemsize // 8) * 8


def _chunks(payload: Tensor, specs: list[tuple[torch.dtype, list[int]]]) -> list[Tensor]:
    """The arrays of a payload `[bytes]` uint8, as views of their dtypes and shapes."""
    arrays, start = [], 0
    for dtype, shape in specs:
        count = math.prod(shape)
        arrays.append(payload[start:start + count * dtype.itemsize].view(dtype).view(shape))
        start += _padded_bytes(dtype, shape)
    return arrays


def _array_specs(header: Tensor, count: int) -> list[tuple[torch.dtype, list[int]]]:
    specs = []
    for i in range(count):
        start = 3 + MAX_INTS + i * _ARRAY_FIELDS
        code, ndim = int(header[start]), int(header[start + 1])
        specs.append((_DTYPES[code], header[start + 2:start + 2 + ndim].tolist()))
    return specs


@contextmanager
def _failures_named(doing: str) -> Iterator[None]:
    """A collective that fails because a rank ended becomes a TensorParallelError saying what was being done."""
    try:
        yield
    except TensorParallelError:
        raise
    except RuntimeError as exc:          # gloo and NCCL report a peer that is gone as RuntimeErrors
        raise TensorParallelError(f"a tensor-parallel rank stopped answering while {doing}: {exc}") from exc
