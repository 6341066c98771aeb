"""Turning logits into tokens for a whole batch at once: greedy, temperature, top-k, top-p, min-p, seeded,
after the per-request controls (slora.sampling.logit_controls) and grammar masks; and the logprobs of the raw logits.

Random draws come from a counter-based hash of (seed, output position, vocabulary index), computed with
tensor ops on the logits' device: no per-request generator, no host round trip per request, and the same
draw on the CPU and on CUDA. A seeded sample is reproduced exactly, also after preemption and recompute,
given the same logits (on CUDA those can differ in their last bits with the batch and between runs).
"""
from collections.abc import Callable, Collection
from collections.abc import Sequence as Rows
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from slora.core.outputs import TokenLogprob
from slora.core.sequence import Sequence, SequenceStatus
from slora.execution.device_copy import to_device
from slora.kernels import reference
from slora.sampling.logit_controls import apply_controls

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """Uniform (0, 1) float32 `[rows, vocab]`, a pure function of (seed, step, column)."""
    columns = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    state = _splitmix64(seeds[:, None] * _GOLDEN + steps[:, None])                # [rows, 1]
    bits = _splitmix64(state + columns[None, :] * _GOLDEN)                        # [rows, vocab]
    return unit_interval(bits)


def unit_interval(bits: Tensor) -> Tensor:
    """The top 23 bits of int64 `bits` as float32 in (0, 1), both ends excluded: (k + 0.5) / 2**23 is exact in
    float32's 24-bit significand. (With 24 bits the largest k rounded to 1.0, whose Gumbel noise is +inf,
    and +inf on a -inf logit is NaN, which argmax picks: a masked token drawn.)"""
    return (_shift_right(bits, 41).float() + 0.5) / float(1 << 23)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters of one step, on the logits' device."""

    temperatures: Tensor   # [rows] float32, 0 = greedy
    top_ks: Tensor         # [rows] int64, 0 = off
    top_ps: Tensor         # [rows] float32
    seeds: Tensor          # [rows] int64
    steps: Tensor          # [rows] int64, the output position being sampled
    min_ps: Tensor | None = None   # [rows] float32; None: no row uses min_p

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], device: torch.device, top_ks: list[int]) -> "SamplingTensors":
        # Greedy rows have no seed; their noise is never used.
        rows = [(s.params.temperature, top_k, s.params.top_p, s.seed or 0, len(s.output_token_ids))
                for s, top_k in zip(seqs, top_ks)]
        temperature, top_k, top_p, seed, step = zip(*rows)
        min_ps = torch.tensor([s.params.min_p for s in seqs]) if any(s.params.min_p for s in seqs) else None
        return cls(torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.int64),
                   torch.tensor(top_p, dtype=torch.float32), torch.tensor(seed, dtype=torch.int64),
                   torch.tensor(step, dtype=torch.int64), min_ps).to(device)

    def to(self, device: torch.device) -> "SamplingTensors":
        def moved(t: Tensor) -> Tensor:
            return to_device(t, device)
        return SamplingTensors(moved(self.temperatures), moved(self.top_ks), moved(self.top_ps), moved(self.seeds),
                               moved(self.steps), None if self.min_ps is None else moved(self.min_ps))


def scale_logits(logits: Tensor, temperatures: Tensor) -> Tensor:
    """Logits `[rows, vocab]` divided by each row's temperature (greedy rows' 0 clamped; argmax decides them)."""
    return logits / temperatures.clamp(min=1e-6)[:, None]


def drop_below_min_p(logits: Tensor, min_ps: Tensor) -> Tensor:
    """Scaled logits `[rows, vocab]` with tokens less likely than min_p times the row's top token -inf."""
    probs = torch.softmax(logits, dim=-1)
    floor = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values             # [rows, 1]
    return logits.masked_fill(probs < floor, float("-inf"))


def filter_logits(logits: Tensor, temperatures: Tensor, top_ks: Tensor, top_ps: Tensor,
                  min_ps: Tensor | None = None) -> Tensor:
    """Scaled logits `[rows, vocab]`, with everything outside each row's top-k and top-p nucleus, or below
    its min-p floor, -inf."""
    logits = scale_logits(logits, temperatures)
    if min_ps is not None:
        logits = drop_below_min_p(logits, min_ps)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    outside_k = (top_ks[:, None] > 0) & (ranks >= top_ks[:, None])
    sorted_logits = sorted_logits.masked_fill(outside_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the first token past p. top_p = 1 keeps every token: the float32 running sum over a large
    # vocabulary can reach 1 before its end, and such a row must equal an unfiltered one (sample's
    # truncate=False), whatever it is batched with.
    outside_p = (top_ps[:, None] < 1) & ((probs.cumsum(dim=-1) - probs) >= top_ps[:, None])
    sorted_logits = sorted_logits.masked_fill(outside_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: Tensor, params: SamplingTensors, truncate: bool = True) -> Tensor:
    """One token per row `[rows]` (on the device): argmax for greedy rows, else Gumbel-max sampling.
    truncate=False: no row has top-k, top-p < 1 or min-p, so the sort over the vocabulary is skipped."""
    greedy = logits.argmax(dim=-1)
    if truncate:
        filtered = filter_logits(logits.float(), params.temperatures, params.top_ks, params.top_ps, params.min_ps)
    else:
        filtered = scale_logits(logits.float(), params.temperatures)
    gumbel = -torch.log(-torch.log(uniform_noise(params.seeds, params.steps, logits.shape[-1])))
    sampled = (filtered + gumbel).argmax(dim=-1)
    return torch.where(params.temperatures == 0, greedy, sampled)


def effective_top_k(seq: Sequence, vocab_size: int) -> int:
    """The sequence's top_k, 0 (off) where it keeps the whole vocabulary: -1, 0, or at least vocab_size."""
    top_k = seq.params.top_k
    return top_k if 0 < top_k < vocab_size else 0


class GrammarMask(Protocol):
    """One sequence's grammar: which tokens it allows next (slora.sampling.grammar's state)."""

    kind: str                   # the spec's kind: json_schema, regex, ...
    slow_tokens: int            # tokens in a row whose grammar work went over the per-token budget

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None: ...

    def push(self, token_id: int) -> None: ...

    def fork(self) -> "GrammarMask": ...


class Masker(Protocol):
    """Applies the grammar masks of a step's rows to its logits (slora.sampling.grammar.GrammarCompiler)."""

    def mask(self, logits: Tensor, grammars: Rows[GrammarMask | None]) -> None: ...


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]     # per row; None where the row asked for none


class DeviceSample(NamedTuple):
    """A step's sampled tokens before they reach the host (`host_result` brings them)."""

    token_ids: Tensor                       # [rows] int64 on the logits' device
    logprob_rows: Tensor | None             # [rows, 3 + 2 * top] float64 (logprob_rows); None: no row asked
    logprob_counts: list[int | None]        # per row: its top count; None where the row asked for no logprobs


class Sampler:
    """Samples a step's rows. Logprobs are those of the raw logits (vLLM's default): log_softmax before the
    controls, the grammar mask and the temperature. Everything is computed on the logits' device, and the
    tokens and their logprobs come to the host in one copy."""

    def __init__(self, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(self, logits: Tensor, seqs: list[Sequence], grammars: Rows[GrammarMask | None] | None = None,
                 masker: Masker | None = None) -> SampleResult:
        """One token per row of `logits` `[seqs, vocab]`; `grammars`: each row's grammar where any has one,
        applied by `masker`."""
        return host_result(self.on_device(logits, seqs, grammars, masker))

    def one_by_one(self, logits: Tensor, seqs: list[Sequence], grammars: Rows[GrammarMask | None] | None,
                   masker: Masker | None, on_error: Callable[[Sequence], None]) -> SampleResult:
        """The rows of `logits` `[seqs, vocab]` sampled one at a time, after the batch raised: a row that
        raises calls `on_error` (its request fails alone) and gets token 0, never read since its sequence
        ends. Rows of sequences already finished are skipped."""
        tokens = [0] * len(seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        for row, seq in enumerate(seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue                               # another sample's fault failed its request
            try:
                result = self(logits[row:row + 1], [seq], grammars and grammars[row:row + 1], masker)
                tokens[row], logprobs[row] = result.token_ids[0], result.logprobs[0]
            except Exception:
                on_error(seq)
        return SampleResult(tokens, logprobs)

    def on_device(self, logits: Tensor, seqs: list[Sequence], grammars: Rows[GrammarMask | None] | None = None,
                  masker: Masker | None = None) -> DeviceSample:
        """As `__call__`, with the tokens and logprobs left on the logits' device: no host sync (but for the
        grammar masks, filled on the host while the GPU runs)."""
        raw = logits
        logits = self._controlled(logits, seqs, grammars, masker)
        tokens = self._tokens(logits, seqs)                                         # [rows] on the device
        wanted = [s.params.logprob_count for s in seqs]
        if all(k is None for k in wanted):
            return DeviceSample(tokens, None, wanted)
        return DeviceSample(tokens, logprob_rows(raw, tokens, max(k or 0 for k in wanted)), wanted)

    def warm_up(self, vocab_size: int, device: torch.device) -> None:
        """Compile the logprob kernels now (on CUDA), so that the first request asking for logprobs does
        not stall a step of every tenant's while they compile."""
        token_logprobs(torch.zeros(1, vocab_size, device=device), torch.zeros(1, dtype=torch.int64, device=device), [1])

    def _controlled(self, logits: Tensor, seqs: list[Sequence], grammars: Rows[GrammarMask | None] | None,
                    masker: Masker | None) -> Tensor:
        """The logits the tokens are drawn from: a float32 copy with controls and masks, where any applies."""
        controlled = any(s.params.logit_bias or s.params.min_tokens or s.params.penalized for s in seqs)
        masked = grammars is not None and any(g is not None for g in grammars)
        if not controlled and not masked:
            return logits
        logits = logits.float().clone()
        if masked:      # first: min_tokens must see what the grammar leaves
            assert masker is not None and grammars is not None, "grammars given to the sampler without a masker"
            masker.mask(logits, grammars)
        return apply_controls(logits, seqs, self.eos_token_ids)

    def _tokens(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        if all(s.params.greedy for s in seqs):
            return logits.argmax(dim=-1)
        top_ks = [effective_top_k(s, logits.shape[-1]) for s in seqs]
        truncate = any(top_ks) or any(s.params.top_p < 1 or s.params.min_p > 0 for s in seqs)
        return sample(logits, SamplingTensors.from_seqs(seqs, logits.device, top_ks), truncate)


def host_result(sample: DeviceSample) -> SampleResult:
    """The sample on the host (waits for it): one copy, of the logprob rows where there are any, as they
    hold the tokens too."""
    if sample.logprob_rows is None:
        return SampleResult(sample.token_ids.tolist(), [None] * len(sample.logprob_counts))
    return unpack(sample.logprob_rows.tolist(), sample.logprob_counts)


def unpack(packed: list[list[float]], counts: list[int | None]) -> SampleResult:
    """A SampleResult from the host copy of `logprob_rows` `[rows, 3 + 2 * top]`, with `counts[row]` best
    tokens per row (None: the row's logprob is not returned)."""
    logprobs = unpack_logprobs(packed, [k or 0 for k in counts])
    return SampleResult([lp.token_id for lp in logprobs],
                        [None if k is None else lp for lp, k in zip(logprobs, counts)])


def unpack_logprobs(packed: list[list[float]], counts: list[int]) -> list[TokenLogprob]:
    """Rows of `logprob_rows` as TokenLogprobs, with `counts[row]` of each row's best tokens."""
    width = (len(packed[0]) - 3) // 2 if packed else 0
    return [TokenLogprob(int(row[0]), row[1], int(row[2]),
                         list(zip(map(int, row[3:3 + k]), row[3 + width:3 + width + k])))
            for row, k in zip(packed, counts)]


def token_logprobs(logits: Tensor, tokens: Tensor, counts: list[int]) -> list[TokenLogprob]:
    """Each row's token `tokens[row]`: its logprob under log_softmax(logits), its rank, and its `counts[row]`
    best (token, logprob). One host copy: every number packed in one float64 tensor (logprob_rows)."""
    return unpack_logprobs(logprob_rows(logits, tokens, max(counts, default=0)).tolist(), counts)


def logprob_rows(logits: Tensor, tokens: Tensor, top: int) -> Tensor:
    """The Triton kernel on CUDA (two launches), the torch reference elsewhere."""
    if logits.is_cuda:
        from slora.kernels import logprobs
        return logprobs.logprob_rows(logits, tokens, top)
    return reference.logprob_rows(logits, tokens, top)
