"""Tool calls parsed out of chat answers (`--enable-auto-tool-choice --tool-call-parser hermes`): the parser's
unit tests, then the real chat route, whose answer guided_choice makes the tiny model write."""
import json

import pytest
from conftest import BASE_MODEL, start_server

from slora.api.protocol import ChatCompletionRequest
from slora.api.tool_calls import (
    ParsedAnswer,
    ToolCall,
    parse_hermes,
    parse_named,
    parse_required,
    parser_for,
    streamable,
    tool_names_of,
)

NAMES = {"get_weather", "get_time"}
WEATHER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "precise": true}}\n</tool_call>'


# ---- the parser ----------------------------------------------------------------------------------------------
def test_one_call():
    assert parse_hermes(WEATHER, NAMES) == ParsedAnswer(None, (ToolCall("get_weather", '{"city": "Paris"}'),))


def test_two_calls_and_the_text_around_them():
    parsed = parse_hermes(f"Let me look.\n{WEATHER}\n{TIME}\nDone.", NAMES)
    assert parsed.tool_calls == (ToolCall("get_weather", '{"city": "Paris"}'),
                                 ToolCall("get_time", '{"zone": "CET", "precise": true}'))
    assert parsed.content == "Let me look.\n\n\nDone."
    assert parse_hermes(f"{WEATHER}\n  {TIME}", NAMES).content is None      # only whitespace outside


def test_malformed_json_stays_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>'
    assert parse_hermes(f"Hi {bad}", NAMES) == ParsedAnswer(f"Hi {bad}", ())
    parsed = parse_hermes(f"{bad}{TIME}", NAMES)                 # the good block still counts
    assert [c.name for c in parsed.tool_calls] == ["get_time"] and parsed.content == bad
    for odd in ('<tool_call>["get_weather"]</tool_call>', '<tool_call>{"name": 3}</tool_call>',
                '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', "<tool_call></tool_call>"):
        assert parse_hermes(odd, NAMES) == ParsedAnswer(odd, ()), odd


def test_unknown_tool_name_stays_content():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_hermes(text, NAMES) == ParsedAnswer(text, ())
    assert parse_hermes(WEATHER, set()) == ParsedAnswer(WEATHER, ())


def test_arguments_as_json_text_or_missing_and_an_unclosed_last_block():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
    assert parse_hermes(text, NAMES).tool_calls == (ToolCall("get_time", '{"zone": "UTC"}'),)
    bare = parse_hermes('<tool_call>{"name": "get_time"}</tool_call>', NAMES)
    assert bare.tool_calls == (ToolCall("get_time", "{}"),)
    unclosed = parse_hermes('Sure. <tool_call>{"name": "get_time", "arguments": {"é": "ü"}}', NAMES)
    assert unclosed == ParsedAnswer("Sure. ", (ToolCall("get_time", '{"é": "ü"}'),))
    assert json.loads(unclosed.tool_calls[0].as_openai()["function"]["arguments"]) == {"é": "ü"}
    assert unclosed.tool_calls[0].as_openai()["id"].startswith("call_")


def test_streamable_holds_back_from_the_first_tag():
    assert streamable("Let me look. <tool_call>{") == "Let me look. "
    assert streamable("Let me look. <tool_") == "Let me look. "
    assert streamable("a < b") == "a < b" and streamable("a <") == "a "
    assert streamable("plain") == "plain"


def test_which_tools_count():
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]})
    assert tool_names_of(request.tools, request.tool_choice) == NAMES
    assert tool_names_of(request.tools, "auto") == NAMES == tool_names_of(request.tools, "required")
    assert tool_names_of(request.tools, "none") is None and tool_names_of(None, "auto") is None
    choice = {"type": "function", "function": {"name": "get_time"}}
    named = ChatCompletionRequest.model_validate({**request.model_dump(exclude_none=True), "tool_choice": choice})
    assert tool_names_of(named.tools, named.tool_choice) == {"get_time"}


def test_a_forced_answer_is_read_as_calls_or_left_as_text():
    required = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {}}]'
    assert parse_required(required, NAMES) == ParsedAnswer(None, (ToolCall("get_time", '{"zone": "CET"}'),
                                                                   ToolCall("get_weather", "{}")))
    for cut in ('[{"name": "get_time", "param', "[]", '[{"name": "rm_rf", "parameters": {}}]',
                '[{"name": "get_time", "parameters": [1]}]', '{"name": "get_time", "parameters": {}}'):
        assert parse_required(cut, NAMES) == ParsedAnswer(cut, ()), cut
    assert parse_named('{"city": "Oslo"}', "get_weather") == ParsedAnswer(None, (ToolCall("get_weather",
                                                                                          '{"city": "Oslo"}'),))
    for cut in ('{"city": "Os', '["Oslo"]'):
        assert parse_named(cut, "get_weather") == ParsedAnswer(cut, ()), cut


def test_which_parser_reads_the_answer():
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    named = parser_for(request.tools, request.tool_choice, hermes=False)
    assert named is not None and named.mode == "named" and named.names == {"get_time"}
    assert named.streamable("{") == ""                       # a forced answer is all call: nothing streams
    required = parser_for(request.tools, "required", hermes=False)
    assert required is not None and required.mode == "required" and required.names == NAMES
    assert parser_for(request.tools, "auto", hermes=False) is None               # "auto" needs the flag
    hermes = parser_for(request.tools, "auto", hermes=True)
    assert hermes is not None and hermes.mode == "hermes" and hermes.streamable("Hi <tool_") == "Hi "
    assert parser_for(request.tools, "none", hermes=True) is None


# ---- the chat route --------------------------------------------------------------------------------------------
ANSWER = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tool-calls"), "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def ask(client, **kwargs):
    return client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          max_tokens=128, temperature=0, extra_body={"guided_choice": [ANSWER]},
                                          **kwargs)


def test_chat_answer_with_a_call(client):
    out = ask(client, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure. "
    call, = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


def streamed(chunks) -> tuple[str, list, list]:
    """A chat stream's content, tool-call deltas and finish reasons (one per choice chunk)."""
    content, calls, reasons = "", [], []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_streamed_chat_answer_sends_the_calls_at_the_end(client):
    content, calls, reasons = streamed(ask(client, tools=TOOLS, stream=True))
    assert content == "Sure. " and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    call, = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_no_parsing_with_tool_choice_none_or_without_the_tool(client):
    for kwargs in ({"tools": TOOLS, "tool_choice": "none"}, {},
                   {"tools": [{"type": "function", "function": {"name": "get_time"}}]}):
        out = ask(client, **kwargs)
        assert out.choices[0].message.content == ANSWER, kwargs
        assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in ask(client, stream=True) if chunk.choices)
    assert streamed == ANSWER


def test_tools_the_chat_template_drops_are_logged_once_per_request(server, client):
    """The tiny model's template, like SmolLM2's, renders no tools: the model is never shown them, which the log
    says of each request that gives some (tests/api/test_unseen_tools.py has the details)."""
    unseen = "the chat template ignores `tools`"
    before = server.log().count(unseen)
    ask(client, tools=TOOLS)
    ask(client, tools=TOOLS, tool_choice="none")     # not rendered with "none": nothing is lost
    ask(client)
    assert server.log().count(unseen) == before + 1


# ---- forced tool choices: "required" and a named function ----------------------------------------------------
CITIES = ["Oslo", "Paris", "Lima"]
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string", "enum": CITIES}}, "required": ["city"],
                    "additionalProperties": False}}},
                {"type": "function", "function": {"name": "get_time", "description": "the time now"}}]


def force(client, tool_choice, **kwargs):
    """A chat request whose answer must be a call: no guided_choice, the tiny random model's own tokens, held to
    the calls' schema. Its whitespace is random too, so max_tokens leaves room (a cut answer would be text)."""
    return client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=FORCED_TOOLS, tool_choice=tool_choice, max_tokens=600, **kwargs)


def assert_valid_call(call, names=("get_weather", "get_time")):
    """A call of one of `names` whose arguments fit that tool's parameters."""
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name in names, call
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"} and arguments["city"] in CITIES, arguments
    else:
        assert arguments == {}, arguments        # no parameters: an empty parameter list


def test_required_tool_choice_forces_a_call(client):
    # One call per answer (parallel_tool_calls false): the random model's greedy array would go on past max_tokens.
    out = force(client, "required", parallel_tool_calls=False, temperature=0)
    choice, = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    call, = choice.message.tool_calls
    assert_valid_call(call)


def test_required_tool_choice_holds_for_every_sample(client):
    out = force(client, "required", parallel_tool_calls=False, temperature=1.0, seed=11, n=4)
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        call, = choice.message.tool_calls
        assert_valid_call(call)


def test_named_tool_choice_calls_that_tool(client):
    for name in ("get_weather", "get_time"):
        out = force(client, {"type": "function", "function": {"name": name}}, temperature=0)
        choice, = out.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        call, = choice.message.tool_calls
        assert_valid_call(call, names=(name,))


def test_a_streamed_forced_call_comes_whole_at_the_end(client):
    content, calls, reasons = streamed(force(client, "required", parallel_tool_calls=False, temperature=0,
                                             stream=True))
    assert content == "" and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    call, = calls
    assert call.index == 0
    assert_valid_call(call)


def test_legacy_functions_and_function_call_are_tools_and_tool_choice(client):
    functions = [tool["function"] for tool in FORCED_TOOLS]
    out = client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                         functions=functions, function_call={"name": "get_weather"},
                                         max_tokens=600, temperature=0)
    choice, = out.choices
    assert choice.finish_reason == "function_call", choice             # OpenAI's legacy answer form
    assert choice.message.function_call.name == "get_weather"
    assert json.loads(choice.message.function_call.arguments)["city"] in CITIES
    call, = choice.message.tool_calls                                   # and the current one
    assert call.function.name == "get_weather" and call.function.arguments == choice.message.function_call.arguments
