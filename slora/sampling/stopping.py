"""A sequence's new token: its logprob, its text, its grammar, and whether the sequence ends."""
from dataclasses import dataclass

from slora.core.outputs import TokenLogprob
from slora.core.sequence import Sequence
from slora.sampling.request_state import RequestState


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


def append_token(state: RequestState, seq: Sequence, token: int, logprob: TokenLogprob | None,
                 eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
    """Append a sampled token to one sample of a request, decode it if the caller reads text as it grows
    (or a stop string must be matched against it) and check the stop conditions; the finish reason, or
    None while the sample goes on. A sample of max_tokens=0 (the prompt alone) ends without its token. Under
    a grammar, the token goes to it, and an EOS (which its mask allows only once the output is complete)
    ends the sample with "stop", even with ignore_eos: the grammar cannot go on."""
    if seq.params.max_tokens == 0:
        return "length"
    state.record_logprob(seq.sample_index, logprob)
    reason = _append_text(state, seq, token, eos_token_ids, max_model_len)
    grammar = state.grammar_of(seq)
    if grammar is None:
        return reason
    if reason is None and token in eos_token_ids:
        state.texts[seq.sample_index] = state.detokenizers[seq.sample_index].final_text()
        return "stop"
    grammar.push(token)
    return reason


def _append_text(state: RequestState, seq: Sequence, token: int, eos_token_ids: frozenset[int],
                 max_model_len: int) -> str | None:
    seq.output_token_ids.append(token)
    index = seq.sample_index                     # its place in state.seqs
    detokenizer = state.detokenizers[index]
    previous_len = len(detokenizer.text)
    decode_now = state.stream or seq.params.stop
    text = detokenizer.add(token) if decode_now else detokenizer.hold(token)
    result = check_stop(seq, text, eos_token_ids, max_model_len, previous_len)
    state.texts[index] = result.text
    if result.reason is not None and (result.reason != "stop" or result.text == detokenizer.text):
        state.texts[index] = detokenizer.final_text()      # no stop string cut: the exact decode
    return result.reason
