"""A chat template that ignores `tools` (SmolLM2's) renders the same prompt with and without a request's tools, so the
model can never call one: the server says so in its log, once per request, instead of failing silently."""
import logging
from types import SimpleNamespace

import pytest

from slora.api.protocol import ChatCompletionRequest
from slora.api.tokenizing import DEFAULT_CHAT_TEMPLATE, template_reads_tools, warn_if_tools_unseen

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
WARNING = "the chat template ignores `tools`"
READS_TOOLS = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['content'] }}"
               "{% endfor %}")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from slora.models.builtin import smollm2_folder
    from slora.models.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_folder())


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def warnings_of(caplog, tokenizer, body: ChatCompletionRequest) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slora.api.tokenizing"):
        warn_if_tools_unseen(tokenizer, body)
    return [record.getMessage() for record in caplog.records if WARNING in record.getMessage()]


def test_smollm2s_template_drops_tools(smollm2_tokenizer):
    def rendered(**kwargs) -> str:
        return smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert rendered(tools=TOOLS) == rendered()          # the premise: the model is never shown the tools
    assert not template_reads_tools(smollm2_tokenizer.chat_template)


def test_templates_that_read_tools_are_told_apart():
    assert template_reads_tools(READS_TOOLS)
    assert template_reads_tools("{% for t in tools %}{{ t.function.name }}{% endfor %}")
    assert not template_reads_tools(DEFAULT_CHAT_TEMPLATE)
    assert not template_reads_tools("{# tools are not shown #}{{ messages[0]['content'] }}")
    # One this parser cannot read (a tokenizer's own tags) counts as reading tools when it names them.
    assert template_reads_tools("{% generation %}{{ tools }}{% endgeneration %}")
    assert not template_reads_tools("{% generation %}{{ messages }}{% endgeneration %}")


def test_a_request_with_tools_on_smollm2_logs_one_warning(caplog, smollm2_tokenizer):
    cases = {"auto": {"tools": TOOLS}, "required": {"tools": TOOLS, "tool_choice": "required"},
             "a named function": {"functions": [TOOLS[0]["function"]], "function_call": {"name": "get_weather"}}}
    for choice, fields in cases.items():
        found = warnings_of(caplog, smollm2_tokenizer, chat(**fields))
        assert len(found) == 1, (fields, found)
        assert "1 tool(s)" in found[0] and f"(tool_choice {choice})" in found[0], found


def test_no_warning_without_tools_or_where_the_template_reads_them(caplog, smollm2_tokenizer):
    assert warnings_of(caplog, smollm2_tokenizer, chat()) == []
    assert warnings_of(caplog, smollm2_tokenizer, chat(tools=TOOLS, tool_choice="none")) == []   # not rendered
    reads = SimpleNamespace(chat_template=READS_TOOLS)
    assert warnings_of(caplog, reads, chat(tools=TOOLS)) == []
