"""Beam search over sequences that share pages: the selection rules of transformers' `generate(num_beams=k)`.

A beam-search request runs as a group of at most `width` sequences, its beams. After each step every live beam
proposes its best continuations (the top entries of its log-softmax row); the group keeps the `width` best by
cumulative logprob. A continuation that ends (a stop token, or the length limit) becomes a finished hypothesis
when it ranks among the best `width`, scored by its cumulative logprob over its length to the power
`length_penalty`; the others continue. The engine forks a beam chosen more than once (the fork shares its
pages, copying only the partial last one on write) and ends the beams not chosen, freeing their own pages.

The rules follow transformers 5's `_beam_search`: `max(2, 1 + stop tokens) * width` continuations are ranked
each step, so that `width` of them always go on; the search ends when the best running beam cannot beat the
worst of `width` finished hypotheses (`early_stopping=False`: judged at the current length; `"never"`: at
the longest length when the penalty rewards length), when `width` hypotheses are in (`early_stopping=True`),
or when every continuation ends. Scores are float32, as there.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from slora.core.outputs import CompletionOutput, TokenLogprob
from slora.core.sequence import Sequence

EARLY_STOPPING = (True, False, "never")


@dataclass(frozen=True, kw_only=True)
class BeamSettings:
    """One request's search: its width, the length penalty and stopping rule, the tokens it may generate
    (max_tokens, or the context left after its prompt), the tokens that end a beam, and the top logprobs
    each output token reports (None: none)."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    stop_token_ids: frozenset[int]
    num_logprobs: int | None = None

    def __post_init__(self) -> None:
        assert self.width >= 1 and self.max_tokens >= 1, "SamplingParams checked the width and max_tokens"
        assert self.early_stopping in EARLY_STOPPING, "SamplingParams checked early_stopping"

    @property
    def continuations_ranked(self) -> int:
        """Continuations ranked per step: enough that `width` go on however many of them end."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    @property
    def proposals_per_beam(self) -> int:
        """Entries of each beam's row that can matter: the best `continuations_ranked`, and the top logprobs."""
        return max(self.continuations_ranked, self.num_logprobs or 0)

    def penalized(self, score: np.float32, length: int) -> np.float32:
        return np.float32(score / np.float32(length ** self.length_penalty))


class Proposal(NamedTuple):
    """A beam's best next tokens and their logprobs, best first."""

    token_ids: list[int]
    logprobs: list[float]


class Continuation(NamedTuple):
    parent: int              # the beam it extends, an index into the group's live beams
    token_id: int
    score: np.float32        # the parent's score plus the token's logprob
    rank: int                # the token's place in the parent's proposal (1: its best)


@dataclass
class Beam:
    """A live beam: its sequence, its cumulative logprob, and its tokens' logprobs when the request asks them."""

    seq: Sequence
    score: np.float32
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Hypothesis:
    token_ids: list[int]
    score: np.float32                # cumulative logprob over length ** length_penalty
    cumulative_logprob: float
    logprobs: list[TokenLogprob]
    finish_reason: str               # "stop": a stop token ends it; "length": the limit


@dataclass
class BeamGroup:
    """The search state of one request: the live beams (best first), the finished hypotheses (at most
    `width`, best first), and whether the search is over."""

    settings: BeamSettings
    beams: list[Beam]
    finished: list[Hypothesis] = field(default_factory=list)
    generated: int = 0               # tokens each live beam has generated
    improvable: bool = True          # whether a running beam may still beat the worst finished hypothesis
    done: bool = False
    offered: dict[int, Proposal] = field(default_factory=dict)   # this step's proposals so far, by seq_id

    @classmethod
    def start(cls, settings: BeamSettings, seq: Sequence) -> "BeamGroup":
        return cls(settings, [Beam(seq, np.float32(0.0))])

    def offer(self, seq: Sequence, proposal: Proposal) -> bool:
        """A live beam's proposal for this step; whether every live beam's is in (a beam scheduled apart from
        the others, as when a step's token budget ran out among them, waits for theirs)."""
        self.offered[seq.seq_id] = proposal
        return len(self.offered) == len(self.beams)

    def advance(self, fork: Callable[[Sequence], Sequence], end: Callable[[Sequence], None]) -> None:
        """With every proposal in: select, then fork the beams chosen more than once (before any gets its
        token), end those not chosen (or all, once the search is over), and append each new beam's token."""
        proposals = [self.offered[beam.seq.seq_id] for beam in self.beams]
        self.offered = {}
        continuations = self.select(proposals)
        taken: set[int] = set()
        seqs = []
        for c in continuations:
            parent = self.beams[c.parent].seq
            seqs.append(fork(parent) if c.parent in taken else parent)
            taken.add(c.parent)
        for index, beam in enumerate(self.beams):
            if index not in taken:
                end(beam.seq)
        self.beams = [self._grown(seq, c, proposals) for seq, c in zip(seqs, continuations, strict=True)]

    def _grown(self, seq: Sequence, continuation: Continuation, proposals: list[Proposal]) -> Beam:
        parent = self.beams[continuation.parent]
        seq.output_token_ids.append(continuation.token_id)
        return Beam(seq, continuation.score, self.logprobs_after(parent, continuation, proposals[continuation.parent]))

    def select(self, proposals: list[Proposal]) -> list[Continuation]:
        """One step: given each live beam's proposal (in `beams`' order), record the continuations that end
        and return the `width` that go on, best first; none once the search is over (`done`)."""
        assert len(proposals) == len(self.beams), "one proposal per live beam"
        ranked = self._rank(proposals)
        length = self.generated + 1
        ends = [self._ends(c.token_id, length) for c in ranked]
        self._record_finished(proposals, ranked, ends, length)
        going_on = [c for c, end in zip(ranked, ends, strict=True) if not end][:self.settings.width]
        self.generated = length
        self._update_improvable(going_on)
        self.done = not self.improvable or self._full_and_stopping() or not going_on
        return [] if self.done else going_on

    def _rank(self, proposals: list[Proposal]) -> list[Continuation]:
        """The best `continuations_ranked` over all beams, ties in (beam, token) order as a flat top-k."""
        every = [Continuation(parent, token, np.float32(beam.score + np.float32(logprob)), rank)
                 for parent, (beam, proposal) in enumerate(zip(self.beams, proposals, strict=True))
                 for rank, (token, logprob) in enumerate(zip(*proposal, strict=True), start=1)]
        every.sort(key=lambda c: (-c.score, c.parent, c.token_id))
        return every[:self.settings.continuations_ranked]

    def _ends(self, token_id: int, length: int) -> bool:
        return token_id in self.settings.stop_token_ids or length >= self.settings.max_tokens

    def _full_and_stopping(self) -> bool:
        return self.settings.early_stopping is True and len(self.finished) == self.settings.width

    def _record_finished(self, proposals: list[Proposal], ranked: list[Continuation], ends: list[bool],
                         length: int) -> None:
        """The ending continuations among the best `width` join the hypotheses, which keep their best `width`;
        none once the hypotheses are full under early stopping, or cannot improve."""
        if not self.improvable or self._full_and_stopping():
            return
        width = self.settings.width
        new = [self._hypothesis(c, proposals[c.parent], length) for c, end in zip(ranked[:width], ends[:width])
               if end]
        if new:
            merged = sorted(self.finished + new, key=lambda h: -h.score)    # stable: earlier ones first on ties
            self.finished = merged[:width]

    def _hypothesis(self, continuation: Continuation, proposal: Proposal, length: int) -> Hypothesis:
        parent = self.beams[continuation.parent]
        token = continuation.token_id
        reason = "stop" if token in self.settings.stop_token_ids else "length"
        return Hypothesis([*parent.seq.output_token_ids, token], self.settings.penalized(continuation.score, length),
                          float(continuation.score), self.logprobs_after(parent, continuation, proposal), reason)

    def logprobs_after(self, parent: Beam, continuation: Continuation, proposal: Proposal) -> list[TokenLogprob]:
        """The parent's token logprobs and the continuation's, when the request asks for them."""
        k = self.settings.num_logprobs
        if k is None:
            return parent.logprobs
        top = list(zip(proposal.token_ids[:k], proposal.logprobs[:k], strict=True))
        logprob = proposal.logprobs[continuation.rank - 1]
        return [*parent.logprobs, TokenLogprob(continuation.token_id, logprob, continuation.rank, top)]

    def _update_improvable(self, going_on: list[Continuation]) -> None:
        """Once `width` hypotheses are in: whether the best running beam, at its best possible length, still
        beats the worst of them."""
        if len(self.finished) < self.settings.width or not going_on:
            return
        settings = self.settings
        length = settings.max_tokens if settings.early_stopping == "never" and settings.length_penalty > 0 \
            else self.generated
        best_possible = settings.penalized(going_on[0].score, length)
        self.improvable = bool(best_possible > min(h.score for h in self.finished))

    def outputs(self, n: int, decode: Callable[[list[int]], str]) -> list[CompletionOutput]:
        """The best `n` hypotheses once the search is over; before (an abort, a failure), the live beams."""
        if self.done:
            return [CompletionOutput(i, h.token_ids, decode(h.token_ids), h.finish_reason, self._reported(h.logprobs),
                                     h.cumulative_logprob) for i, h in enumerate(self.finished[:n])]
        return [CompletionOutput(i, list(b.seq.output_token_ids), decode(b.seq.output_token_ids),
                                 b.seq.finish_reason, self._reported(b.logprobs), float(b.score))
                for i, b in enumerate(self.beams[:n])]

    def _reported(self, logprobs: list[TokenLogprob]) -> list[TokenLogprob] | None:
        return None if self.settings.num_logprobs is None else list(logprobs)


def propose(logits: Tensor, sizes: list[int]) -> list[Proposal]:
    """Each row's best `sizes[i]` tokens by log-softmax of `logits` `[rows, vocab]`, in float32 as transformers
    ranks them; one copy to the host for all rows."""
    if not sizes:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)                      # [rows, vocab]
    values, ids = logprobs.topk(min(max(sizes), logprobs.shape[-1]), dim=-1)  # [rows, k], best first
    host_values: list[list[float]] = values.cpu().tolist()
    host_ids: list[list[int]] = ids.cpu().tolist()
    return [Proposal(host_ids[row][:size], host_values[row][:size]) for row, size in enumerate(sizes)]
