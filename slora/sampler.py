"""Turning logits into tokens for a whole batch at once: greedy, temperature, top-k, top-p, seeded.

Random draws come from a counter-based hash of (seed, output position, vocabulary index), computed with
tensor ops on the logits' device: no per-request generator, no host round trip per request, and the same
draw on the CPU and on CUDA. A seeded sample is reproduced exactly, also after preemption and recompute,
given the same logits (on CUDA those can differ in their last bits with the batch and between runs).
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from slora.sequence import Sequence

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
    return (_shift_right(bits, 40).float() + 0.5) / float(1 << 24)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters of one step, on the logits' device."""

    temperatures: Tensor   # [rows] float32, 0 = greedy
    top_ks: Tensor         # [rows] int64, 0 = off
    top_ps: Tensor         # [rows] float32
    seeds: Tensor          # [rows] int64
    steps: Tensor          # [rows] int64, the output position being sampled

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], device: torch.device, top_ks: list[int]) -> "SamplingTensors":
        # Greedy rows have no seed; their noise is never used.
        rows = [(s.params.temperature, top_k, s.params.top_p, s.seed or 0, len(s.output_token_ids))
                for s, top_k in zip(seqs, top_ks)]
        temperature, top_k, top_p, seed, step = zip(*rows)
        return cls(torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.int64),
                   torch.tensor(top_p, dtype=torch.float32), torch.tensor(seed, dtype=torch.int64),
                   torch.tensor(step, dtype=torch.int64)).to(device)

    def to(self, device: torch.device) -> "SamplingTensors":
        return SamplingTensors(*(t.to(device, non_blocking=True) for t in self.__dict__.values()))


def scale_logits(logits: Tensor, temperatures: Tensor) -> Tensor:
    """Logits `[rows, vocab]` divided by each row's temperature (greedy rows' 0 clamped; argmax decides them)."""
    return logits / temperatures.clamp(min=1e-6)[:, None]


def filter_logits(logits: Tensor, temperatures: Tensor, top_ks: Tensor, top_ps: Tensor) -> Tensor:
    """Scaled logits `[rows, vocab]`, with everything outside each row's top-k and top-p nucleus -inf."""
    logits = scale_logits(logits, temperatures)
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
    truncate=False: no row has top-k or top-p < 1, so the sort over the vocabulary is skipped."""
    greedy = logits.argmax(dim=-1)
    if truncate:
        filtered = filter_logits(logits.float(), params.temperatures, params.top_ks, params.top_ps)
    else:
        filtered = scale_logits(logits.float(), params.temperatures)
    gumbel = -torch.log(-torch.log(uniform_noise(params.seeds, params.steps, logits.shape[-1])))
    sampled = (filtered + gumbel).argmax(dim=-1)
    return torch.where(params.temperatures == 0, greedy, sampled)


def effective_top_k(seq: Sequence, vocab_size: int) -> int:
    """The sequence's top_k, 0 (off) where it keeps the whole vocabulary: -1, 0, or at least vocab_size."""
    top_k = seq.params.top_k
    return top_k if 0 < top_k < vocab_size else 0


class Sampler:
    def __call__(self, logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` `[seqs, vocab]`; one device-to-host copy for the whole batch."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(dim=-1).tolist()
        top_ks = [effective_top_k(s, logits.shape[-1]) for s in seqs]
        truncate = any(top_ks) or any(s.params.top_p < 1 for s in seqs)
        return sample(logits, SamplingTensors.from_seqs(seqs, logits.device, top_ks), truncate).tolist()
