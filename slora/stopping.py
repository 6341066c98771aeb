"""When a sequence ends, and its text."""
from dataclasses import dataclass

from slora.sequence import Sequence


@dataclass(frozen=True)
class StopResult:
    reason: str | None         # "stop" | "length" | None (go on)
    text: str


def check_stop(seq: Sequence, text: str, eos_token_ids: frozenset[int], max_model_len: int,
               previous_len: int = 0) -> StopResult:
    """Check the stop conditions after `seq` got a new token whose decoded output is `text` (of which
    the first `previous_len` characters were already checked)."""
    params, last = seq.params, seq.output_token_ids[-1]
    if not params.ignore_eos and last in eos_token_ids:
        return StopResult("stop", text)
    if last in params.stop_token_set:
        return StopResult("stop", text)
    for stop in params.stop:
        cut = text.find(stop, max(0, previous_len - len(stop) + 1))   # only where the new text can complete it
        if cut >= 0:
            return StopResult("stop", text[:cut])
    if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return StopResult("length", text)
    return StopResult(None, text)
