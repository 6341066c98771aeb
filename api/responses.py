"""The answers of a finished job (completion and chat completion objects), and the logprobs and usage in them."""
import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

from slora.api import tool_calls
from slora.api.jobs import Job
from slora.api.response_models import (
    AssistantFunctionCall,
    AssistantMessage,
    AssistantToolCall,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    ModelCard,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
)
from slora.api.tokenizer_pool import Tokenizer
from slora.core.outputs import CompletionOutput, RequestOutput, TokenLogprob

LOGPROB_FLOOR = -9999.0                     # what -inf (and NaN) logprobs are reported as: JSON has no -inf
TokenText = Callable[[int], str]            # a token id's text, as logprobs show it
LogprobList = Sequence[TokenLogprob | None] | None


class TokenTexts:
    """Each token id's text for logprobs, as vLLM shows it: the id decoded alone, special tokens included.
    Decoded once per id with a copy of the tokenizer used only on the event loop, then remembered."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._source = tokenizer
        self._tokenizer: Any = None
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self._source is None:
                return f"token_id:{token_id}"
            if self._tokenizer is None:
                self._tokenizer = copy.deepcopy(self._source)   # never shared with the tokenizer threads
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    @staticmethod
    def as_id(token_id: int) -> str:
        return f"token_id:{token_id}"


# ---- logprobs, as OpenAI and vLLM show them ------------------------------------------------------------------
def logprob_value(value: float) -> float:
    """A logprob as JSON can carry it: -inf and NaN become LOGPROB_FLOOR (as vLLM reports them)."""
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def padded(token_ids: Sequence[int], logprobs: LogprobList) -> list[TokenLogprob | None]:
    """One entry per token: what `logprobs` has, then None (for positions it lacks)."""
    entries = list(logprobs or [])[:len(token_ids)]
    return entries + [None] * (len(token_ids) - len(entries))


def completion_logprobs(token_ids: Sequence[int], logprobs: LogprobList, top: int, token_text: TokenText,
                        offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs of some tokens (the prompt's first has none: null) and the text offset after
    them. top_logprobs holds the `top` most likely tokens and the token itself."""
    made = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entry in zip(token_ids, padded(token_ids, logprobs)):
        text = token_text(token_id)
        made["tokens"].append(text)
        made["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            made["token_logprobs"].append(None)
            made["top_logprobs"].append(None)
            continue
        value = logprob_value(entry.logprob)
        made["token_logprobs"].append(value)
        made["top_logprobs"].append(_top_texts(entry, top, token_text, text, value))
    return made, offset


def _top_texts(entry: TokenLogprob, top: int, token_text: TokenText, text: str, value: float) -> dict[str, float]:
    """The `top` most likely tokens' texts and logprobs, and the token's own (when not among them)."""
    best: dict[str, float] = {}
    for candidate, candidate_logprob in entry.top[:top]:
        best.setdefault(token_text(candidate), logprob_value(candidate_logprob))
    best.setdefault(text, value)
    return best


def chat_logprobs(token_ids: Sequence[int], logprobs: LogprobList, top: int, token_text: TokenText) -> ChatLogprobs:
    """OpenAI's chat logprobs of some output tokens: `{"content": [...]}`."""
    def entry_of(token_id: int, logprob: float) -> ChatTopLogprob:
        text = token_text(token_id)
        return ChatTopLogprob(token=text, logprob=logprob_value(logprob), bytes=list(text.encode("utf-8")))
    content = [ChatTokenLogprob(**entry_of(token_id, entry.logprob),
                                top_logprobs=[entry_of(candidate, value) for candidate, value in entry.top[:top]])
               for token_id, entry in zip(token_ids, padded(token_ids, logprobs)) if entry is not None]
    return ChatLogprobs(content=content)


def prompt_logprobs(token_ids: Sequence[int], logprobs: LogprobList, top: int,
                    token_text: TokenText) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the token itself and the `top` most likely there."""
    if logprobs is None:
        return None
    positions: PromptLogprobs = []
    for token_id, entry in zip(token_ids, padded(token_ids, logprobs)):
        if entry is None:
            positions.append(None)
            continue
        position = {str(token_id): PromptLogprob(logprob=logprob_value(entry.logprob), rank=entry.rank,
                                                 decoded_token=token_text(token_id))}
        for rank, (candidate, value) in enumerate(entry.top[:top], 1):
            position.setdefault(str(candidate), PromptLogprob(logprob=logprob_value(value), rank=rank,
                                                              decoded_token=token_text(candidate)))
        positions.append(position)
    return positions


# ---- usage, model cards, tool calls -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def model_card(model_id: str, created: int, owned_by: str, parent: str | None, max_model_len: int | None) -> ModelCard:
    return ModelCard(id=model_id, object="model", created=created, owned_by=owned_by, root=model_id, parent=parent,
                     max_model_len=max_model_len)


def made_calls(calls: Sequence[tool_calls.ToolCall]) -> list[AssistantToolCall]:
    return [AssistantToolCall.model_validate(call.as_openai()) for call in calls]


def legacy_call(job: Job, made: list[AssistantToolCall]) -> AssistantFunctionCall | None:
    """For a request that gave the legacy `functions`, the first call also as function_call, where such clients
    read it (the legacy form has one call)."""
    return made[0].function if job.legacy_functions and made else None


def calls_reason(job: Job) -> str:
    """The finish_reason of an answer that made calls: OpenAI's legacy "function_call" for `functions`."""
    return "function_call" if job.legacy_functions else "tool_calls"


# ---- a job's answers ----------------------------------------------------------------------------------------------
class JobAnswers:
    """The answer objects of one job: its choices, their logprobs in its form, its usage."""

    def __init__(self, job: Job, token_texts: TokenText) -> None:
        self.job = job
        self.token_text: TokenText = TokenTexts.as_id if job.tokens_as_ids else token_texts

    def usage(self) -> Usage:
        return usage(self.job.prompt_tokens(), self.job.completion_tokens(), self.job.cached_tokens())

    def chat_logprobs(self, sample: CompletionOutput, start: int, end: int | None = None) -> ChatLogprobs | None:
        """The chat logprobs of sample tokens [start:end]."""
        if self.job.logprobs is None:
            return None
        end = len(sample.token_ids) if end is None else end
        logprobs = None if sample.logprobs is None else sample.logprobs[start:end]
        return chat_logprobs(sample.token_ids[start:end], logprobs, self.job.logprobs, self.token_text)

    def completion_logprobs(self, out: RequestOutput, sample: CompletionOutput, start: int, with_prompt: bool,
                            end: int | None = None, offset: int = 0) -> tuple[CompletionLogprobs | None, int]:
        """The legacy logprobs of sample tokens [start:end], after the prompt's with `with_prompt` (echo), and the
        text offset after them."""
        if self.job.logprobs is None:
            return None, offset
        end = len(sample.token_ids) if end is None else end
        token_ids = sample.token_ids[start:end]
        logprobs = padded(token_ids, None if sample.logprobs is None else sample.logprobs[start:end])
        if with_prompt:
            token_ids = out.prompt_token_ids + token_ids
            logprobs = padded(out.prompt_token_ids, out.prompt_logprobs) + logprobs
        return completion_logprobs(token_ids, logprobs, self.job.logprobs, self.token_text, offset)

    def prompt_logprobs(self, out: RequestOutput) -> PromptLogprobs | None:
        return prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.job.prompt_logprobs or 0,
                               self.token_text)

    def completion(self) -> Completion:
        job = self.job
        choices = [self._completion_choice(index, position, sample)
                   for index in range(len(job.prompts)) for position, sample in enumerate(job.finals[index].outputs)]
        return Completion(id=job.response_id, object="text_completion", created=job.created, model=job.model,
                          choices=choices, usage=self.usage())

    def chat(self) -> ChatCompletion:
        job = self.job
        choices = [self._chat_choice(position, sample) for position, sample in enumerate(job.finals[0].outputs)]
        answer = ChatCompletion(id=job.response_id, object="chat.completion", created=job.created, model=job.model,
                                choices=choices, usage=self.usage())
        if job.prompt_logprobs is not None:          # vLLM puts it beside the choices
            answer.prompt_logprobs = self.prompt_logprobs(job.finals[0])
        return answer

    def _completion_choice(self, index: int, position: int, sample: CompletionOutput) -> CompletionChoice:
        """Prompt `index`'s sample at `position` (with best_of, the best first)."""
        job, out = self.job, self.job.finals[index]
        echo = job.echo[index] if job.echo else ""
        logprobs, _ = self.completion_logprobs(out, sample, 0, job.echo_logprobs)
        choice = CompletionChoice(index=job.choice_index(index, position), text=echo + sample.text,
                                  logprobs=logprobs, finish_reason=sample.finish_reason)
        if job.return_token_ids:
            choice.token_ids, choice.prompt_token_ids = sample.token_ids, out.prompt_token_ids
        if job.prompt_logprobs is not None:
            choice.prompt_logprobs = self.prompt_logprobs(out)
        return choice

    def _chat_choice(self, position: int, sample: CompletionOutput) -> ChatChoice:
        """One chat choice; with tool parsing, the calls in its text as message.tool_calls (and the first as
        the legacy message.function_call for a request that gave `functions`)."""
        job = self.job
        echo = job.echo[0] if job.echo else ""
        parsed = None if job.tool_parser is None else job.tool_parser.parse(sample.text)
        message = AssistantMessage(role="assistant", content=echo + sample.text)
        reason = sample.finish_reason
        if parsed is not None and parsed.tool_calls:
            message.content = (echo + (parsed.content or "")) or None
            message.tool_calls = made_calls(parsed.tool_calls)
            if (legacy := legacy_call(job, message.tool_calls)) is not None:
                message.function_call = legacy
            reason = calls_reason(job)
        choice = ChatChoice(index=job.choice_index(0, position), message=message,
                            logprobs=self.chat_logprobs(sample, 0), finish_reason=reason)
        if job.return_token_ids:
            choice.token_ids, choice.prompt_token_ids = sample.token_ids, job.finals[0].prompt_token_ids
        return choice
