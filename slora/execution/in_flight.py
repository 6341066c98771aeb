"""A step whose sampled tokens are still on their way to the host: under overlapped scheduling the engine
launches the next step's forward before it reads them (DESIGN §3)."""
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from slora.core.outputs import TokenLogprob
from slora.core.scheduler import ScheduledSeq
from slora.core.sequence import Sequence
from slora.core.step_stats import StepTimer
from slora.sampling.sampler import DeviceSample, SampleResult, host_result


class ArrivingSample(Protocol):
    def result(self) -> SampleResult: ...


class PinnedBuffers:
    """Host buffers that successive steps' samples are copied into, in turn, so that no step pays the host for
    a pinned allocation. The engine reads step i's copy (HostCopy.result) before step i + 1 samples, so one
    buffer would do; the second is a step of margin."""

    COUNT = 2

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: list[Tensor | None] = [None] * self.COUNT
        self._next = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """A host tensor of `shape` and `dtype`: a view of the next buffer, which grows to twice its size when
        too small (logprob rows vary in width)."""
        nbytes = shape.numel() * dtype.itemsize
        buffer = self._buffers[self._next]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, 2 * (0 if buffer is None else buffer.numel()), 4096)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            self._buffers[self._next] = buffer
        self._next = (self._next + 1) % self.COUNT
        return buffer[:nbytes].view(dtype).view(shape)


class HostCopy:
    """A step's sampled ids (or its logprob rows, which hold them) copied into pinned host memory behind
    the step's kernels: `result` waits for that copy alone, not for the forward queued after it."""

    def __init__(self, sample: DeviceSample, buffers: PinnedBuffers) -> None:
        self._event: torch.cuda.Event | None = None
        self._sample = sample
        source = sample.logprob_rows if sample.logprob_rows is not None else sample.token_ids
        if source.is_cuda:
            host = buffers.take(source.shape, source.dtype)
            host.copy_(source, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            # host_result reads the logprob rows where there are any, else the ids: the copied one.
            self._sample = sample._replace(logprob_rows=host) if sample.logprob_rows is not None \
                else sample._replace(token_ids=host)

    def result(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        return host_result(self._sample)


class ReadySample:
    """A sample already on the host (rows sampled one by one after the batch raised)."""

    def __init__(self, result: SampleResult) -> None:
        self._result = result

    def result(self) -> SampleResult:
        return self._result


class Launched(NamedTuple):
    """A step whose forward is queued: what its sampling needs."""

    scheduled: list[ScheduledSeq]
    completing: list[Sequence]        # logits row i samples completing[i]
    logits: Tensor                    # [rows, vocab], not read yet
    timer: StepTimer


class InFlight(NamedTuple):
    seqs: list[Sequence]          # row i: seqs[i], whose pending_row is i
    token_ids: Tensor             # [rows] int64 on the device: the next step's pending input ids
    arriving: ArrivingSample      # the same tokens (and logprobs), coming to the host
    timer: StepTimer


class TokensInFlight:
    """The overlap's bookkeeping: the step whose sampled tokens are still on their way to the host. The next
    step's forward reads them on the device (`on_device`) before the host has them (`take`)."""

    def __init__(self, *, pin: bool) -> None:
        self._flight: InFlight | None = None
        self._buffers = PinnedBuffers(pin=pin)     # where each step's tokens arrive
        self._last_step_end = 0.0                  # perf_counter when the last step's tokens arrived

    def on_device(self) -> Tensor | None:
        """The ids `[rows]` of the step in flight, on the device; None when no step is in flight."""
        return None if self._flight is None else self._flight.token_ids

    def copy_to_host(self, sample: DeviceSample) -> HostCopy:
        return HostCopy(sample, self._buffers)

    def send(self, seqs: list[Sequence], token_ids: Tensor, arriving: ArrivingSample, timer: StepTimer) -> None:
        """Put a step in flight: row i of `token_ids` is the pending token of seqs[i]."""
        assert self._flight is None, "the step before's tokens are taken before the next step samples"
        for row, seq in enumerate(seqs):
            seq.pending_row = row
        self._flight = InFlight(seqs, token_ids, arriving, timer)

    def take(self) -> Iterable[tuple[Sequence, int, TokenLogprob | None]]:
        """The tokens of the step in flight once they are on the host (waiting for them), by sequence; the
        step's wall time ends here."""
        flight, self._flight = self._flight, None
        if flight is None:
            return ()
        result = flight.arriving.result()
        self._last_step_end = flight.timer.stop(self._last_step_end)
        for seq in flight.seqs:
            seq.pending_row = None
        return zip(flight.seqs, result.token_ids, result.logprobs)      # read once, every step: no list built
