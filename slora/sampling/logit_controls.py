"""Per-request controls on the logits, batched over the rows of one step: logit_bias, min_tokens, and the
presence, frequency and repetition penalties. Each is one tensor op over `[rows, vocab]`, built from the
step's rows that use it; rows at the neutral value are untouched."""
from collections.abc import Collection

import torch
from torch import Tensor

from slora.core.sequence import Sequence
from slora.execution.device_copy import tensor_on


def apply_controls(logits: Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> Tensor:
    """`logits` `[rows, vocab]` float32 with each row's controls applied (in place where any applies)."""
    _apply_logit_bias(logits, seqs)
    _mask_until_min_tokens(logits, seqs, eos_token_ids)
    if any(s.params.penalized for s in seqs):
        _apply_penalties(logits, seqs)
    return logits


def _apply_logit_bias(logits: Tensor, seqs: list[Sequence]) -> None:
    entries = [(row, token, bias) for row, s in enumerate(seqs) for token, bias in s.params.logit_bias.items()]
    if not entries:
        return
    rows, tokens, biases = zip(*entries)
    index = (tensor_on(rows, torch.int64, logits.device), tensor_on(tokens, torch.int64, logits.device))
    logits.index_put_(index, tensor_on(biases, logits.dtype, logits.device), accumulate=True)


def _mask_until_min_tokens(logits: Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> None:
    """Rows short of min_tokens cannot end: their EOS (unless ignored) and stop_token_ids are -inf, except in
    a row where nothing else is left (a grammar that allows only its end): that one still ends."""
    entries = [(row, token) for row, s in enumerate(seqs) if len(s.output_token_ids) < s.params.min_tokens
               for token in _ending_tokens(s, eos_token_ids)]
    if not entries:
        return
    rows, tokens = (tensor_on(ids, torch.int64, logits.device) for ids in zip(*entries))
    ending = logits[rows, tokens]                                                  # [entries]
    logits[rows, tokens] = float("-inf")
    stuck = (logits[rows] == float("-inf")).all(dim=-1)                            # [entries]
    logits[rows, tokens] = torch.where(stuck, ending, float("-inf"))


def _ending_tokens(seq: Sequence, eos_token_ids: Collection[int]) -> set[int]:
    eos = set() if seq.params.ignore_eos else set(eos_token_ids)
    return eos | seq.params.stop_token_set


def _apply_penalties(logits: Tensor, seqs: list[Sequence]) -> None:
    """vLLM's semantics: repetition divides positive and multiplies negative logits of every token seen
    in the prompt or the output; frequency subtracts per output occurrence, presence once per output token."""
    device, vocab = logits.device, logits.shape[-1]
    output_counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)      # [rows, vocab]
    seen = (_token_counts([s.prompt_token_ids for s in seqs], vocab, device) + output_counts) > 0
    repetition = _row_values(seqs, "repetition_penalty", device)                          # [rows, 1]
    logits.copy_(torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits))
    logits -= _row_values(seqs, "frequency_penalty", device) * output_counts
    logits -= _row_values(seqs, "presence_penalty", device) * (output_counts > 0)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """`[rows, vocab]` float32: how often each token occurs in each row's list (one scatter for all rows)."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    if width:
        padded = [t + [vocab] * (width - len(t)) for t in token_lists]          # pads count in a spare column
        index = tensor_on(padded, torch.int64, device)
        counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _row_values(seqs: list[Sequence], name: str, device: torch.device) -> Tensor:
    return tensor_on([getattr(s.params, name) for s in seqs], torch.float32, device)[:, None]
