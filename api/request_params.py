"""The one place where a request's fields become SamplingParams: only those the request set are passed."""
import re
from typing import Any

from slora.api.errors import bad_request
from slora.api.protocol import SamplingRequest
from slora.sampling.params import SamplingParams
from slora.sampling.structured_output import StructuredOutput

# Request fields that SamplingParams takes under the same name. One the request leaves out (None) is not passed,
# so that SamplingParams' own default applies: the defaults live there alone.
SAME_NAME_FIELDS = ("temperature", "top_p", "top_k", "seed", "n", "best_of", "ignore_eos", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "stop_token_ids")
_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")
# SamplingParams' refusal of what beam search does not combine with lists them: the first is the one named.
_BEAM_REFUSAL = re.compile(r"use_beam_search does not support ([^,;]+)")
_BEAM_REFUSAL_FIELDS = {"temperature other than 0 or 1": "temperature", "stop strings": "stop"}
_STRUCTURED = "structured output"


def to_sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                       prompt_logprobs: int | None = None, structured: StructuredOutput | None = None,
                       structured_param: str | None = None) -> SamplingParams:
    """The request's SamplingParams, with what the service derives from it: max_tokens (known once the prompt is
    tokenized), the logprobs in the engine's form, the structured output (given by `structured_param`). A 400
    names a field SamplingParams refuses."""
    given: dict[str, Any] = {name: getattr(body, name) for name in SAME_NAME_FIELDS}
    given.update(stop=body.stop_list if body.stop is not None else None,
                 logit_bias=body.logit_bias_ids if body.logit_bias is not None else None,
                 logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)
    given.update(beam_search_fields(body))
    try:
        return SamplingParams(max_tokens=max_tokens, **{name: value for name, value in given.items()
                                                        if value is not None})
    except ValueError as exc:
        param = param_named(exc) or beam_search_refused(exc, structured_param)
        raise bad_request(without_class_name(exc), param=param) from None


def beam_search_fields(body: SamplingRequest) -> dict[str, Any]:
    """The beam-search fields as SamplingParams takes them: with use_beam_search the width is best_of (else n),
    so best_of is no sampling best_of then. length_penalty and early_stopping go as given, so that SamplingParams
    refuses them without use_beam_search."""
    fields: dict[str, Any] = {"length_penalty": body.length_penalty, "early_stopping": body.early_stopping}
    if body.use_beam_search:
        fields.update(use_beam_search=True, beam_width=body.best_of or body.n, best_of=None)
    return fields


def param_named(exc: ValueError) -> str | None:
    """The field a SamplingParams refusal names (its messages say `SamplingParams.<field>`), if any."""
    found = _PARAM_IN_MESSAGE.search(str(exc))
    return found.group(1) if found else None


def beam_search_refused(exc: ValueError, structured_param: str | None) -> str | None:
    """The request field of the first thing SamplingParams' refusal of a beam search names (`structured_param`
    for a structured output); use_beam_search itself for words that are no field; None for another refusal."""
    found = _BEAM_REFUSAL.search(str(exc))
    if found is None:
        return None
    named = found.group(1).strip()
    if named == _STRUCTURED:
        return structured_param or "use_beam_search"
    field = _BEAM_REFUSAL_FIELDS.get(named, named)
    return field if field in SamplingRequest.model_fields else "use_beam_search"


def without_class_name(exc: ValueError) -> str:
    """A SamplingParams refusal as the client reads it: the field's name without the class's."""
    return str(exc).replace("SamplingParams.", "")
