"""The server-sent events of a streamed job: one chunk per new piece of each choice, then [DONE]."""
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from slora.api.async_engine import EngineUnavailable
from slora.api.errors import APIError, internal_error, unavailable
from slora.api.jobs import Job
from slora.api.response_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    StreamedToolCall,
    Usage,
)
from slora.api.responses import JobAnswers, calls_reason, legacy_call, made_calls, usage
from slora.core.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)
DONE_EVENT = "data: [DONE]\n\n"
# (prompt index, its cumulative output) as the engine requests of a job produce them.
Outputs = Callable[[], AsyncGenerator[tuple[int, RequestOutput], None]]


def sse(chunk: BaseModel) -> str:
    """One event of a chunk; the fields it leaves unset stay out (see response_models)."""
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def withhold(text: str, stops: list[str]) -> str:
    """The part of a running sample's text that is safe to send: without a trailing partial UTF-8
    character (decoded as U+FFFD, which the next token may complete) and without a suffix that may be the
    start of a stop string (which would then be cut from the final text)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    text = text[:end]
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return text[:end]


@dataclass
class ChoiceProgress:
    """What has been sent of one choice (one sample of one prompt)."""

    sent_text: str = ""
    sent_tokens: int = 0
    finish_reason: str | None = None
    started: bool = False                  # its first event (with the echo, if any) went out
    text_offset: int = 0                   # of the next token in its logprobs (legacy completions format)

    def advance(self, text: str, token_ids: list[int], finish_reason: str | None,
                stops: list[str]) -> tuple[str, list[int], bool]:
        """(text delta, token delta, whether it just finished) for a new cumulative output."""
        visible = text if finish_reason is not None else withhold(text, stops)
        delta = ""
        if visible.startswith(self.sent_text):
            delta = visible[len(self.sent_text):]
            self.sent_text = visible
        new_tokens = token_ids[self.sent_tokens:]
        self.sent_tokens = len(token_ids)
        just_finished = finish_reason is not None and self.finish_reason is None
        self.finish_reason = finish_reason or self.finish_reason
        return delta, new_tokens, just_finished


class JobEvents:
    """The events of one streamed job. Its outputs come from `outputs`; an error once the stream has started is
    sent as an error event (the status is already 200), then [DONE]."""

    def __init__(self, job: Job, answers: JobAnswers, outputs: Outputs) -> None:
        self.job = job
        self.answers = answers
        self.outputs = outputs
        self.progress: dict[int, ChoiceProgress] = {}

    async def events(self) -> AsyncGenerator[str, None]:
        job = self.job
        try:
            async for event in self._answer():
                yield event
        except EngineUnavailable:
            job.outcome = "error"
            yield unavailable("the engine stopped while generating").sse_event()
        except APIError as exc:
            job.outcome = "error"
            yield exc.sse_event()
        except Exception:             # a bug must not leave the client hanging: report it in the stream
            logger.exception("stream %s failed", job.response_id)
            job.outcome = "error"
            yield internal_error().sse_event()
        yield DONE_EVENT

    async def _answer(self) -> AsyncGenerator[str, None]:
        job = self.job
        if job.kind == "chat":                   # each choice starts with the role (and vLLM's echo)
            delta = ChatDelta(role="assistant", content=job.echo[0] if job.echo else "")
            for choice in range(len(job.prompts) * job.params.n):
                yield self._chunk([ChatChunkChoice(index=choice, delta=delta, logprobs=None, finish_reason=None)])
        async with contextlib.aclosing(self.outputs()) as outputs:
            async for index, output in outputs:
                for event in self._delta_events(index, output):
                    yield event
        if job.aborted():
            job.outcome = "shutdown"
            yield unavailable("the server is shutting down; retry later").sse_event()
        elif job.include_usage:
            yield self._chunk([], self.answers.usage())

    def _delta_events(self, index: int, output: RequestOutput) -> list[str]:
        events = []
        for sample in output.outputs:
            if sample.finish_reason == "abort":
                continue
            choice = self._delta_choice(index, output, sample)
            if choice is not None:
                events.append(self._chunk([choice]))
        return events

    def _delta_choice(self, index: int, output: RequestOutput,
                      sample: CompletionOutput) -> CompletionChoice | ChatChunkChoice | None:
        """The chunk choice of what is new in `sample`; None when nothing is."""
        job = self.job
        choice = job.choice_index(index, sample.index)
        state = self.progress.setdefault(choice, ChoiceProgress())
        start = state.sent_tokens
        # With tool parsing the text from the first <tool_call> on (a forced call: all) waits for the end.
        shown = job.tool_parser.streamable(sample.text) if job.tool_parser is not None else sample.text
        text, tokens, finished = state.advance(shown, sample.token_ids, sample.finish_reason, job.params.stop)
        if not text and not tokens and not finished:
            return None
        first, state.started = not state.started, True
        job.sent_tokens[(index, sample.index)] = state.sent_tokens
        reason = sample.finish_reason if finished else None
        made: CompletionChoice | ChatChunkChoice
        if job.kind == "chat":
            made = self._chat_delta(choice, sample, state, text, reason, start)
        else:
            logprobs, state.text_offset = self.answers.completion_logprobs(
                output, sample, start, first and job.echo_logprobs, state.sent_tokens, state.text_offset)
            echo = job.echo[index] if job.echo and first else ""
            made = CompletionChoice(index=choice, text=echo + text, logprobs=logprobs, finish_reason=reason)
        if job.return_token_ids:
            made.token_ids = tokens
        return made

    def _chat_delta(self, choice: int, sample: CompletionOutput, state: ChoiceProgress, text: str,
                    reason: str | None, start: int) -> ChatChunkChoice:
        delta = ChatDelta(content=text) if text or reason is None else ChatDelta()
        if self.job.tool_parser is not None and reason is not None:
            delta, reason = self._final_tool_delta(sample, state, text, reason)
        return ChatChunkChoice(index=choice, delta=delta,
                               logprobs=self.answers.chat_logprobs(sample, start, state.sent_tokens),
                               finish_reason=reason)

    def _final_tool_delta(self, sample: CompletionOutput, state: ChoiceProgress, text: str,
                          reason: str) -> tuple[ChatDelta, str]:
        """The last delta of a streamed choice with tool parsing: the content held back (from the first
        <tool_call> on) that is not a call, and the calls, all at once; `text` is what streamable() let out in
        this chunk."""
        assert self.job.tool_parser is not None, "only for jobs that parse tool calls"
        parsed = self.job.tool_parser.parse(sample.text)
        content = parsed.content or ""
        held = content[len(state.sent_text):] if content.startswith(state.sent_text) else ""
        state.sent_text += held
        delta = ChatDelta(content=text + held) if text or held else ChatDelta()
        if not parsed.tool_calls:
            return delta, reason
        made = made_calls(parsed.tool_calls)
        delta.tool_calls = [StreamedToolCall(index=i, id=call.id, type=call.type, function=call.function)
                            for i, call in enumerate(made)]
        if (legacy := legacy_call(self.job, made)) is not None:
            delta.function_call = legacy
        return delta, calls_reason(self.job)

    def _chunk(self, choices: Sequence[CompletionChoice | ChatChunkChoice], total: Usage | None = None) -> str:
        """One event: `choices`, and the usage as the request asked for it (`total` in the last chunk)."""
        job = self.job
        fields: dict[str, Any] = {"id": job.response_id, "object": job.chunk_name, "created": job.created,
                                  "model": job.model, "choices": choices}
        if total is not None:
            fields["usage"] = total
        elif job.continuous_usage:
            fields["usage"] = usage(job.prompt_tokens(), job.streamed_tokens())
        elif job.include_usage:
            fields["usage"] = None           # there, as OpenAI sends it: null but in the last chunk
        return sse((ChatCompletionChunk if job.kind == "chat" else CompletionChunk).model_validate(fields))
