"""The run-time checks of a generation request: the server's limits, and the rules pydantic cannot check."""
from slora.api.errors import bad_request
from slora.api.protocol import ChatCompletionRequest, NamedFunction, SamplingRequest
from slora.api.settings import ServerSettings
from slora.api.tokenizer_pool import Tokenizer
from slora.api.tokenizing import template_reserved_names
from slora.sampling.structured_output import StructuredOutput


class RequestChecks:
    """Checks of the settings' limits (tighter than the request models' hard caps) and of what depends on the
    model; each refusal is a 400 naming the field."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings

    def check(self, body: SamplingRequest, num_prompts: int, text_chars: int, prompt_param: str, vocab_size: int,
              tokenizer: Tokenizer | None) -> None:
        """The checks of the raw request, before any tokenizer work is done for it."""
        self._check_samples(body, num_prompts)
        self._check_stops(body.stop_list)
        if text_chars > self.settings.max_prompt_chars:
            raise bad_request(f"{prompt_param} has {text_chars} characters of text; the limit is "
                              f"{self.settings.max_prompt_chars} per request (max_prompt_chars)", param=prompt_param,
                              code="request_too_large")
        _check_streaming(body)
        _check_token_ids(body, vocab_size)
        if isinstance(body, ChatCompletionRequest):
            _check_chat(body, tokenizer)

    def _check_samples(self, body: SamplingRequest, num_prompts: int) -> None:
        if body.n > self.settings.max_n:
            raise bad_request(f"n must be between 1 and {self.settings.max_n}", param="n")
        if body.best_of is not None and body.best_of > self.settings.max_n:
            raise bad_request(f"best_of must be between n and {self.settings.max_n}", param="best_of")
        samples, name = (body.best_of, "best_of") if body.best_of is not None else (body.n, "n")
        if num_prompts * samples > self.settings.max_choices:
            raise bad_request(f"prompts x {name} must be at most {self.settings.max_choices}, got {num_prompts} x "
                              f"{samples}", param=name)

    def _check_stops(self, stops: list[str]) -> None:
        if len(stops) > self.settings.max_stop_sequences:
            raise bad_request(f"at most {self.settings.max_stop_sequences} stop sequences are allowed", param="stop")
        if any(len(s) > self.settings.max_stop_length for s in stops):
            raise bad_request(f"stop sequences must be 1 to {self.settings.max_stop_length} characters",
                              param="stop")

    def max_tokens(self, prompts: list[list[int]], max_tokens: int | None, prompt_param: str, context: int) -> int:
        """The request's max_tokens once its prompts are tokens: without one, what the context leaves (within the
        server's limit); a 400 when the prompt and the answer do not fit the model's context."""
        longest = max(len(p) for p in prompts)
        _check_prompt_fits(longest, context, max_tokens == 0, prompt_param)
        limit = self.settings.max_tokens_limit or context
        if max_tokens is None:
            return min(limit, context - longest)
        if max_tokens > limit:
            raise bad_request(f"max_tokens must be between 0 and {limit}", param="max_tokens")
        if longest + max_tokens > context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                              f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                              "completion).", param="max_tokens", code="context_length_exceeded")
        return max_tokens


def _check_prompt_fits(longest: int, context: int, prompt_only: bool, prompt_param: str) -> None:
    """A prompt alone (max_tokens 0, a loglikelihood) may fill the context; otherwise one token must fit after it."""
    if longest == 0:
        raise bad_request("the prompt is empty", param=prompt_param)
    if longest > context or (longest == context and not prompt_only):
        needs = "" if prompt_only else " (at least one token must be generated)"
        raise bad_request(f"This model's maximum context length is {context} tokens, but the prompt has "
                          f"{longest} tokens{needs}.", param=prompt_param, code="context_length_exceeded")


def _check_streaming(body: SamplingRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    # A beam search's width (best_of) may exceed n: its beams are known only at its end anyway, and streamed then.
    if body.stream and not body.use_beam_search and body.best_of is not None and body.best_of > body.n:
        raise bad_request("best_of greater than n is not supported with stream=true (the best samples are "
                          "known only at the end)", param="best_of")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream=true", param="prompt_logprobs")


def _check_token_ids(body: SamplingRequest, vocab: int) -> None:
    outside = sorted(token for token in body.logit_bias_ids if token >= vocab)
    if outside:
        raise bad_request(f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})"
                          + (f" ({len(outside)} such ids)" if len(outside) > 1 else ""), param="logit_bias")


def _check_chat(body: ChatCompletionRequest, tokenizer: Tokenizer | None) -> None:
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          param="continue_final_message")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          param="continue_final_message")
    _check_tools(body)
    if body.chat_template_kwargs and tokenizer is not None:
        reserved = template_reserved_names(tokenizer)
        clashes = sorted(key for key in body.chat_template_kwargs if key in reserved)
        if clashes:
            raise bad_request(f"chat_template_kwargs may not set {clashes[0]!r}: it is a parameter of the "
                              "template call, not a template variable", param="chat_template_kwargs")


def _check_tools(body: ChatCompletionRequest) -> None:
    """tools or the legacy functions, not both; a forced tool choice needs tools and names one of them."""
    if body.tools is not None and body.functions is not None:
        raise bad_request("tools and functions cannot both be given: functions is the deprecated form of tools",
                          param="functions")
    if body.tool_choice is not None and body.function_call is not None:
        raise bad_request("tool_choice and function_call cannot both be given: function_call is the deprecated "
                          "form of tool_choice", param="function_call")
    forced, param = body.forced_tool(), body.tool_choice_param
    tools = body.effective_tools()
    if forced is not None and not tools:
        given = '"required"' if forced == "required" else "a named function"
        raise bad_request(f"{param} {given} needs tools (or functions) to call", param=param)
    if isinstance(forced, NamedFunction) and forced.name not in {t.function.name for t in tools or ()}:
        raise bad_request(f"{param} names the function {forced.name!r}, which is not among the request's "
                          f"{'tools' if body.tools is not None else 'functions'}", param=param)


def structured_output(body: SamplingRequest) -> tuple[str | None, StructuredOutput | None]:
    """The one structured output the request asks for (response_format, guided_*, structured_outputs)."""
    try:
        given = body.structured_outputs_given()
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    names = [name for name, _ in given]
    forced = next((name for name in names if name in ("tool_choice", "function_call")), None)
    if forced is not None and len(given) > 1:
        other = next(name for name in names if name != forced)
        kinds = '"required" or a named function' if forced == "tool_choice" else "a named function"
        raise bad_request(f"{forced} and {other} cannot both be given: a forced {forced} ({kinds}) makes the "
                          "answer the call's JSON, a structured output of its own", param=other)
    if len(given) > 1:
        raise bad_request(f"{' and '.join(names)} cannot both be given: a request takes one structured output",
                          param=names[1])
    return given[0] if given else (None, None)


def check_priority(priority: int, policy: str) -> None:
    """A priority the engine's scheduling policy would ignore is refused, as vLLM refuses it without its priority
    policy."""
    if priority and policy == "fcfs":
        raise bad_request("priority needs the server's --scheduling-policy to be priority or vtc; it schedules "
                          "first come, first served", param="priority")
