"""Turning logits into tokens, per request: greedy, temperature, top-k, top-p, seeded."""
import torch
from torch import Tensor

from slora.sequence import Sequence

_SEED_MIX = 0x9E3779B97F4A7C15


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on (seed, output position), so a seeded sample is reproduced
    exactly, also after the sequence was preempted and recomputed."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + step) % (2 ** 63))
    return generator


def filter_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Scaled logits `[vocab]` with everything outside top-k and the top-p nucleus set to -inf."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the first over p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int) -> None:
        self._unseeded = torch.Generator().manual_seed(seed)

    def __call__(self, logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` `[seqs, vocab]`."""
        greedy = logits.argmax(dim=-1).tolist()
        return [greedy[i] if seq.params.greedy else self._sample_one(logits[i], seq)
                for i, seq in enumerate(seqs)]

    def _sample_one(self, logits: Tensor, seq: Sequence) -> int:
        params = seq.params
        probs = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)
        seed = seq.seed
        generator = self._unseeded if seed is None else step_generator(seed, len(seq.output_token_ids), probs.device)
        if probs.device != torch.device("cpu") and seed is None:
            probs = probs.cpu()
        return int(torch.multinomial(probs, 1, generator=generator))
