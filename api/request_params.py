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


def to_sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                       prompt_logprobs: int | None = None,
                       structured: StructuredOutput | None = None) -> SamplingParams:
    """The request's SamplingParams, with what the service derives from it: max_tokens (known once the prompt is
    tokenized), the logprobs in the engine's form, the structured output. A 400 names a field SamplingParams
    refuses."""
    given: dict[str, Any] = {name: getattr(body, name) for name in SAME_NAME_FIELDS}
    given.update(stop=body.stop_list if body.stop is not None else None,
                 logit_bias=body.logit_bias_ids if body.logit_bias is not None else None,
                 logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)
    try:
        return SamplingParams(max_tokens=max_tokens, **{name: value for name, value in given.items()
                                                        if value is not None})
    except ValueError as exc:
        raise bad_request(without_class_name(exc), param=param_named(exc)) from None


def param_named(exc: ValueError) -> str | None:
    """The field a SamplingParams refusal names (its messages say `SamplingParams.<field>`), if any."""
    found = _PARAM_IN_MESSAGE.search(str(exc))
    return found.group(1) if found else None


def without_class_name(exc: ValueError) -> str:
    """A SamplingParams refusal as the client reads it: the field's name without the class's."""
    return str(exc).replace("SamplingParams.", "")
