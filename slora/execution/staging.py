"""The CUDA graphs' static inputs, filled by one host-to-device copy per step.

A graph replay reads a dozen small tensors. Copying each from the host costs a pin and a copy launch apiece,
more host time than the rest of staging a step. Here every static tensor is a view of one device byte
buffer, and a step is written into a pinned host twin of that buffer with the same layout, then sent whole.

There are two twins, used in turn: under overlapped scheduling the host writes step N+1 while step N's copy
may still be queued behind the GPU's work, so the twin it reads must not be written over. Before a twin is
written again, the host waits for the copy that last read it (in practice long done: the host waits for a
step's sampled ids before it stages the step after next).
"""
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from slora.execution import step_batch
from slora.execution.step_batch import HostArrays, Sizes, StepBatch
from slora.kernels.layout import align_up

# Every region starts on this many bytes, so that a view of any dtype is aligned.
REGION_ALIGN = 16
TWINS = 2


class _Region(NamedTuple):
    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype


def _layout(tensors: Mapping[str, Tensor]) -> tuple[dict[str, _Region], int]:
    """Each tensor's region of the buffer, and the buffer's size in bytes."""
    regions, end = {}, 0
    for name, tensor in tensors.items():
        regions[name] = _Region(end, tensor.nbytes, tensor.shape, tensor.dtype)
        end = align_up(end + tensor.nbytes, REGION_ALIGN)
    return regions, end


def _views(buffer: Tensor, regions: Mapping[str, _Region]) -> dict[str, Tensor]:
    """The named tensors of a byte buffer."""
    return {name: buffer[r.offset:r.offset + r.nbytes].view(r.dtype).view(r.shape) for name, r in regions.items()}


class StagedBuffers:
    """Named device tensors and the pinned host twins that fill them, one copy per `send`."""

    def __init__(self, initial: Mapping[str, Tensor], device: torch.device) -> None:
        regions, nbytes = _layout(initial)
        pin = device.type == "cuda"
        self._device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
        twins = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(TWINS)]
        self._twin_bytes = twins
        self.device_tensors = _views(self._device_bytes, regions)
        self.twin_tensors = [_views(twin, regions) for twin in twins]
        for tensors in self.twin_tensors:
            for name, tensor in tensors.items():
                tensor.copy_(initial[name])
        self._device_bytes.copy_(twins[0])
        # Per twin, the end of the copy that last read it (an event never recorded is complete).
        self._sent = [torch.cuda.Event() for _ in range(TWINS)] if pin else None
        self._current = 0

    def begin(self) -> int:
        """The twin the next step is written into, once the copy that last read it has run."""
        if self._sent is not None:
            self._sent[self._current].synchronize()
        return self._current

    def send(self) -> None:
        """Copy the current twin to the device (queued on the current stream), and turn to the other."""
        self._device_bytes.copy_(self._twin_bytes[self._current], non_blocking=True)
        if self._sent is not None:
            self._sent[self._current].record()
        self._current = (self._current + 1) % TWINS


class BatchViews(NamedTuple):
    """A graph's StepBatch on the device, and its fields in each host twin as numpy views (made once: a
    tensor's `.numpy()` per step would cost the host as much as the copies), views of the staged buffers."""
    device: StepBatch[Tensor]
    twins: tuple[HostArrays, ...]


class Twin(NamedTuple):
    """The host twin a step is written into, between `StagedBatch.begin` and `send`."""
    batch: HostArrays                  # the graph's views of it
    extras: Mapping[str, np.ndarray]   # numpy views of its extra tensors, whole


class StagedBatch:
    """A graph set's static StepBatch (and extra tensors beside it), staged through StagedBuffers."""

    def __init__(self, template: StepBatch[Tensor], device: torch.device,
                 extras: Mapping[str, Tensor] | None = None) -> None:
        """template: the static buffers' sizes and initial values, on the host (step_batch.empty)."""
        tensors = step_batch.tensors_of(template)
        assert not set(tensors) & set(extras or {}), "an extra named as a StepBatch field"
        self._buffers = StagedBuffers({**tensors, **(extras or {})}, device)
        self.device = step_batch.with_tensors(template, self._buffers.device_tensors)
        self._twins = tuple(step_batch.with_tensors(template, t) for t in self._buffers.twin_tensors)
        self._twin_extras = tuple({name: tensors[name].numpy() for name in extras or {}}
                                  for tensors in self._buffers.twin_tensors)

    def views(self, sizes: Sizes, with_lora: bool) -> BatchViews:
        """The leading `sizes` of the static batch, on the device and in every twin (step_batch.view)."""
        twins = tuple(step_batch.host_arrays(step_batch.view(twin, sizes, with_lora)) for twin in self._twins)
        return BatchViews(step_batch.view(self.device, sizes, with_lora), twins)

    def device_extra(self, name: str) -> Tensor:
        return self._buffers.device_tensors[name]

    def begin(self, views: BatchViews) -> Twin:
        """The host twin that the next step is written into (then `send`), with `views`' cut of its batch."""
        twin = self._buffers.begin()
        return Twin(views.twins[twin], self._twin_extras[twin])

    def send(self) -> None:
        self._buffers.send()
