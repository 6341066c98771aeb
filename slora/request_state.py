"""One request inside the engine: its samples, their texts as they are decoded, and why it failed."""
from dataclasses import dataclass, field

from slora.detokenizer import IncrementalDetokenizer
from slora.outputs import CompletionOutput, RequestError, RequestOutput
from slora.sequence import Sequence, SequenceStatus


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

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        samples = [CompletionOutput(s.sample_index, list(s.output_token_ids), self.texts[i], s.finish_reason)
                   for i, s in enumerate(self.seqs)]
        return RequestOutput(self.request_id, self.prompt_token_ids, samples, self.finished,
                             self.seqs[0].num_cached_tokens, self.error)

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.num_samples


def check_prompt(prompt: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt the engine can take: ValueError naming what is wrong with it."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is "
                         f"{max_model_len} tokens, including at least one generated")
