"""A step whose sampled tokens are still on their way to the host: under overlapped scheduling the engine
launches the next step's forward before it reads them (DESIGN §3)."""
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from slora.sampler import DeviceSample, SampleResult, host_result
from slora.sequence import Sequence
from slora.step_stats import StepTimer


class ArrivingSample(Protocol):
    def result(self) -> SampleResult: ...


class HostCopy:
    """A step's sampled ids (or its logprob rows, which hold them) copied into pinned host memory behind
    the step's kernels: `result` waits for that copy alone, not for the forward queued after it."""

    def __init__(self, sample: DeviceSample) -> None:
        self._event: torch.cuda.Event | None = None
        self._sample = sample
        source = sample.logprob_rows if sample.logprob_rows is not None else sample.token_ids
        if source.is_cuda:
            host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
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


class InFlight(NamedTuple):
    seqs: list[Sequence]          # row i: seqs[i], whose pending_row is i
    token_ids: Tensor             # [rows] int64 on the device: the next step's pending input ids
    arriving: ArrivingSample      # the same tokens (and logprobs), coming to the host
    timer: StepTimer
