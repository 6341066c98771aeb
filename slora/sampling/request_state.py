"""One request inside the engine: its samples, their texts as they are decoded, and why it failed."""
import dataclasses
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from slora.core.outputs import CompletionOutput, RequestError, RequestOutput, TokenLogprob
from slora.core.scheduler import ScheduledSeq, Scheduler
from slora.core.sequence import AdapterRef, Sequence, SequenceStatus
from slora.execution.device_copy import tensor_on
from slora.execution.step_batch import prompt_logits
from slora.sampling.beam_search import BeamGroup
from slora.sampling.detokenizer import IncrementalDetokenizer, fast_decoder
from slora.sampling.params import SamplingParams
from slora.sampling.sampler import GrammarMask, token_logprobs


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    adapter_version: str | None
    texts: list[str] = field(default_factory=list)
    num_samples: int = 1              # samples 1.. are forked from sample 0 after its prefill
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    stream: bool = True               # the caller reads outputs while it runs (False: only the final one)
    error: RequestError | None = None  # why the engine failed it (its unfinished samples end with "error")
    logprobs: list[list[TokenLogprob]] = field(default_factory=lambda: [[]])   # per sample, per output token
    cumulative_logprobs: list[float] = field(default_factory=lambda: [0.0])
    prompt_logprobs: list[TokenLogprob | None] | None = None    # position p: the logprob of prompt token p
    grammars: list[GrammarMask] | None = None   # per sample, with SamplingParams.structured
    # A beam search's state (its live beams are `seqs`), and how its outputs are decoded to text.
    beams: BeamGroup | None = None
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        if self.seqs[0].params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    def add_sample(self, detokenizer: IncrementalDetokenizer) -> None:
        """Room for one more sample (a fork of the first)."""
        self.texts.append("")
        self.detokenizers.append(detokenizer)
        self.logprobs.append([])
        self.cumulative_logprobs.append(0.0)
        if self.grammars is not None:           # forks are made before the first sample's first token
            self.grammars.append(self.grammars[0].fork())

    def grammar_of(self, seq: Sequence) -> "GrammarMask | None":
        return None if self.grammars is None else self.grammars[seq.sample_index]

    def record_logprob(self, index: int, logprob: TokenLogprob | None) -> None:
        """The logprob of sample `index`'s new token (None when neither logprobs nor best_of needs it)."""
        if logprob is None:
            return
        self.cumulative_logprobs[index] += logprob.logprob
        if self.seqs[index].params.logprobs is not None:
            self.logprobs[index].append(logprob)

    def store_prompt_logprobs(self, positions: range, logits: Tensor) -> None:
        """Row i of `logits` `[positions, vocab]` predicts prompt token positions[i] + 1."""
        k = self.seqs[0].params.prompt_logprobs
        assert self.prompt_logprobs is not None and k is not None, "prompt logits of a request that asked none"
        first, last = positions.start + 1, positions.stop + 1
        targets = tensor_on(self.prompt_token_ids[first:last], torch.int64, logits.device)
        self.prompt_logprobs[first:last] = token_logprobs(logits, targets, [k] * len(targets))

    def output(self) -> RequestOutput:
        n = self.seqs[0].params.n
        if self.beams is not None:
            assert self.decode is not None, "set with beams"
            return RequestOutput(self.request_id, self.prompt_token_ids, self.beams.outputs(n, self.decode),
                                 self.finished, self.seqs[0].num_cached_tokens, self.error, self.prompt_logprobs)
        samples = [self._sample_output(i, s) for i, s in enumerate(self.seqs)]
        if len(samples) > n:      # best_of: the n samples of highest cumulative logprob, best first
            best = sorted(samples, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
            samples = [dataclasses.replace(c, index=i) for i, c in enumerate(best)]
        return RequestOutput(self.request_id, self.prompt_token_ids, samples, self.finished,
                             self.seqs[0].num_cached_tokens, self.error, self.prompt_logprobs)

    def _sample_output(self, index: int, seq: Sequence) -> CompletionOutput:
        logprobs = list(self.logprobs[index]) if seq.params.logprobs is not None else None
        return CompletionOutput(seq.sample_index, list(seq.output_token_ids), self.texts[index], seq.finish_reason,
                                logprobs, self.cumulative_logprobs[index])

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.num_samples


def step_grammars(requests: dict[str, RequestState], seqs: list[Sequence]) -> list[GrammarMask | None] | None:
    """Each row's grammar for the sampler, or None when no row has one (the common step: no lookups)."""
    if all(s.params.structured is None for s in seqs):
        return None
    return [requests[s.request_id].grammar_of(s) for s in seqs]


def record_prompt_logprobs(requests: dict[str, RequestState], scheduled: list[ScheduledSeq], logits: Tensor,
                           on_error: Callable[[Sequence], None]) -> None:
    """Store the prompt logprobs of a step's rows past its sampled ones (`logits` `[rows, vocab]`); a request
    whose rows raise gets `on_error` and fails alone."""
    for item, positions, rows in prompt_logits(scheduled, logits):
        if item.seq.status is SequenceStatus.FINISHED:
            continue
        try:
            requests[item.seq.request_id].store_prompt_logprobs(positions, rows)
        except Exception:
            on_error(item.seq)


def check_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  max_num_seqs: int, max_beam_width: int) -> None:
    """A request the engine can take: ValueError naming what is wrong with it."""
    width = params.beam_search_width
    if width is not None and width > max_beam_width:
        raise ValueError(f"a beam width of {width} exceeds the server's max_beam_width={max_beam_width}")
    if params.num_samples > max_num_seqs:
        raise ValueError(f"{params.num_samples} samples (n or best_of) exceed max_num_seqs={max_num_seqs}")
    check_prompt(prompt, vocab_size, max_model_len)
    check_token_ids(params, vocab_size)


def check_prompt(prompt: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt the engine can take: ValueError naming what is wrong with it."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if not ids_in_vocabulary(prompt, vocab_size):
        raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is "
                         f"{max_model_len} tokens, including at least one generated")


def ids_in_vocabulary(ids: list[int], vocab_size: int) -> bool:
    """Whether every entry is an integer in [0, vocab_size). One numpy pass rather than a Python test per
    token: the offline API adds hundreds of 1,024-token prompts before its first step, with the GPU idle."""
    try:
        array = np.asarray(ids)            # [len(ids)]; float, str, None or huge entries give another dtype
    except (ValueError, OverflowError):    # ragged nested entries
        return False
    if array.ndim != 1:
        return False
    if array.size == 0:                    # numpy makes [] float: no entry, none outside
        return True
    return array.dtype.kind in "iu" and int(array.min()) >= 0 and int(array.max()) < vocab_size


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in the sampling parameters lie in the vocabulary: ValueError naming the field."""
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        outside = sorted(t for t in ids if t >= vocab_size)
        if outside:
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab_size}): "
                             f"{reprlib.repr(outside)}")


class SequenceMaker:
    """Makes the sequences of requests, numbered in order: a request's first sample at admission, the others
    forked from it after its prefill, sharing its pages."""

    def __init__(self, scheduler: Scheduler, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._scheduler, self._tokenizer = scheduler, tokenizer
        self._decode = None if tokenizer is None else fast_decoder(tokenizer)
        self._next_id = 0

    def new(self, request_id: str, prompt: list[int], params: SamplingParams, ref: AdapterRef | None,
            salt: bytes, *, tenant: str | None = None, priority: int = 0, index: int = 0) -> Sequence:
        self._next_id += 1
        return Sequence(self._next_id, request_id, list(prompt), params, ref, sample_index=index, cache_salt=salt,
                        tenant=tenant, priority=priority)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        """A whole output's text at once (none without a tokenizer)."""
        return "" if self._decode is None else self._decode(token_ids)

    def copy(self, seq: Sequence, index: int = 0) -> Sequence:
        """A new sequence of `seq`'s prompt, request, adapter, tenant and priority: sample `index`."""
        return self.new(seq.request_id, seq.prompt_token_ids, seq.params, seq.adapter, seq.cache_salt,
                        tenant=seq.tenant, priority=seq.priority, index=index)

    def fork(self, parent: Sequence, index: int = 0) -> Sequence:
        """A copy of running `parent` sharing its pages (copy-on-write), its output so far included: a forked
        sample, or a beam taking another of its parent's continuations."""
        child = self.copy(parent, index)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_cached_tokens = parent.num_cached_tokens
        self._scheduler.fork(parent, child)
        return child

    def fork_samples(self, state: RequestState) -> list[Sequence]:
        """After the first sample's prefill, the other samples start as copies sharing its pages."""
        children = [self.fork(state.seqs[0], i) for i in range(1, state.num_samples)]
        for child in children:
            state.seqs.append(child)
            state.add_sample(self.detokenizer())
        return children
