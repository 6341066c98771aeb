"""What real clients send: every documented OpenAI and vLLM request field is accepted, unknown ones
are ignored with a warning, unimplemented ones are refused by name, and the accepted ones reach the engine's
SamplingParams and the chat template as they should. In-process (TestClient) over a real tiny engine, whose
add_request records what it was given."""
import json
import logging

import pytest
from conftest import BASE_MODEL, assert_error_shape, in_process_client, record_requests

from slora.api.app import create_app
from slora.api.settings import ServerSettings
from slora.config import EngineConfig
from slora.engine import Engine
from slora.models.builtin import TINY_MODEL
from slora.sampling.structured_output import StructuredOutput

# A chat template that shows everything the server passes it: tool calls and tool results in messages, tools,
# documents and a variable from chat_template_kwargs.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m.tool_calls %} calls={{ m.tool_calls | tojson }}{% endif %}"
            "{% if m.tool_call_id %} result-of={{ m.tool_call_id }}{% endif %}\n{% endfor %}"
            "{% if tools %}tools={{ tools | tojson }}\n{% endif %}"
            "{% if documents %}documents={{ documents | tojson }}\n{% endif %}"
            "{% if greeting %}greeting={{ greeting }}\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(client, records, engine): records gets (prompt ids, SamplingParams) of every engine request."""
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=64))
    engine.tokenizer.chat_template = TEMPLATE
    records = record_requests(engine)
    settings = ServerSettings(adapter_store=str(tmp_path_factory.mktemp("adapter-store")))
    with in_process_client(engine, settings) as client:
        yield client, records, engine


def completion(client, **fields):
    return client.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 2, **fields})


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                     **fields})


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    assert_error_shape(response.json(), status)
    return response.json()["error"]


def sse_payloads(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ---- accepted ------------------------------------------------------------------------------------------
def test_every_completions_field_is_accepted_and_mapped(app):
    client, records, _ = app
    body = ok(completion(client, prompt="Hello", max_tokens=3, temperature=0.7, top_p=0.9, n=1, best_of=2, seed=7,
                         stop=["zz"], user="u-1", presence_penalty=0.5, frequency_penalty=-0.5,
                         logit_bias={"5": 10, "7": -100}, echo=False, logprobs=2, suffix="", top_k=40, min_p=0.05,
                         repetition_penalty=1.1, min_tokens=1, ignore_eos=True, stop_token_ids=[3],
                         skip_special_tokens=True, spaces_between_special_tokens=True,
                         include_stop_str_in_output=False, add_special_tokens=True, use_beam_search=False,
                         length_penalty=1.0, early_stopping=False, allowed_token_ids=[], bad_words=[], priority=0,
                         request_id="abc",
                         guided_decoding_backend="xgrammar", return_tokens_as_token_ids=False,
                         truncate_prompt_tokens=100, response_format={"type": "text"}, return_token_ids=True))
    _, params = records[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (3, 0.7, 0.9, 40, 7)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (params.min_tokens, params.min_p, params.best_of, params.logprobs) == (1, 0.05, 2, 2)
    assert params.logit_bias == {5: 10.0, 7: -100.0}            # string keys became token ids
    assert params.stop == ["zz"] and params.stop_token_ids == [3] and params.ignore_eos
    assert params.structured is None and params.prompt_logprobs is None
    assert len(body["choices"]) == 1                             # best_of=2 ran two, n=1 came back


def test_every_chat_field_is_accepted(app):
    client, records, _ = app
    ok(chat(client, store=False, service_tier="auto", reasoning_effort="low", metadata={"team": "eval"},
            parallel_tool_calls=True, modalities=["text"], user="u-2", audio=None, web_search_options=None,
            prediction={"type": "content", "content": "Hello"}, prompt_cache_key="k", safety_identifier="s",
            verbosity="low", prompt_cache_retention="24h", moderation=None,
            tools=[TOOL], tool_choice="auto", logprobs=True, top_logprobs=3, echo=False, include_reasoning=True,
            max_completion_tokens=1, max_tokens=2, add_generation_prompt=True, continue_final_message=False,
            chat_template_kwargs={"greeting": "hi"}, documents=[{"title": "a", "text": "b"}], add_special_tokens=False,
            mm_processor_kwargs=None, chat_template=None, n=2, best_of=2))
    _, params = records[-1]
    assert params.max_tokens == 1                  # max_completion_tokens wins over max_tokens
    assert params.logprobs == 3 and params.n == 2
    streamed = chat(client, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False,
                                                         "include_obfuscation": False})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n"), streamed.text
    ok(chat(client, functions=[TOOL["function"]], function_call="auto"))
    ok(chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, tools=[TOOL]))
    ok(chat(client, tool_choice="required", tools=[TOOL], stream_options=None))


def test_nulls_stand_for_defaults(app):
    client, records, _ = app
    nulls = dict(temperature=None, top_p=None, stop=None, seed=None, user=None, presence_penalty=None,
                 frequency_penalty=None, logit_bias=None, stream=None, stream_options=None, top_k=None, min_p=None,
                 repetition_penalty=None, min_tokens=None, response_format=None, ignore_eos=None)
    ok(completion(client, **nulls, echo=None, logprobs=None, suffix=None, best_of=None))
    ok(chat(client, **nulls, logprobs=None, top_logprobs=None, tools=None, tool_choice=None, metadata=None,
            store=None, service_tier=None))
    _, params = records[-1]
    assert (params.temperature, params.repetition_penalty, params.logprobs, params.logit_bias) == (1.0, 1.0, None, {})


def test_unknown_fields_are_ignored_and_logged(app, caplog):
    client, _, _ = app
    with caplog.at_level(logging.WARNING, logger="slora.api.protocol"):
        ok(completion(client, no_such_field=1, another_one={"x": 1}))
        streamed = chat(client, stream=True, stream_options={"include_usage": True, "future_option": True})
        assert streamed.status_code == 200, streamed.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "slora.api.protocol"]
    assert any("CompletionRequest" in w and "no_such_field" in w and "another_one" in w for w in warnings), warnings
    assert any("StreamOptions" in w and "future_option" in w for w in warnings), warnings


def test_tool_messages_tools_documents_and_template_kwargs_reach_the_template(app):
    client, records, engine = app
    messages = [{"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    documents = [{"title": "Oslo", "text": "Capital of Norway"}]
    ok(chat(client, messages=messages, tools=[TOOL], documents=documents, chat_template_kwargs={"greeting": "hej"}))
    prompt, _ = records[-1]
    rendered = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},   # arguments as JSON
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    text = engine.tokenizer.apply_chat_template(rendered, tools=[TOOL], documents=documents, greeting="hej",
                                                tokenize=False, add_generation_prompt=True)
    assert 'calls=[{"id": "call_1"' in text and "result-of=call_1" in text and "tools=" in text, text
    assert "documents=" in text and "greeting=hej" in text
    assert prompt == engine.tokenizer.encode(text, add_special_tokens=False)


def test_legacy_functions_are_rendered_as_tools(app):
    client, records, engine = app
    ok(chat(client, functions=[TOOL["function"]], function_call={"name": "get_weather"}))
    prompt, _ = records[-1]
    text = engine.tokenizer.decode(prompt)
    assert "tools=" in text and "get_weather" in text, text


def test_continue_final_message_leaves_the_last_message_open(app):
    client, records, engine = app
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    ok(chat(client, messages=messages, add_generation_prompt=False, continue_final_message=True))
    prompt, _ = records[-1]
    assert engine.tokenizer.decode(prompt).endswith("<|assistant|>The answer is")
    error = error_of(chat(client, messages=messages, continue_final_message=True))   # add_generation_prompt too
    assert error["param"] == "continue_final_message"


def test_chat_echo_starts_the_answer_with_the_last_message(app):
    client, _, _ = app
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]
    body = ok(chat(client, messages=messages, add_generation_prompt=False, continue_final_message=True, echo=True))
    assert body["choices"][0]["message"]["content"].startswith("Sure:")
    ok(chat(client, echo=True))               # the last message is the user's: nothing to echo
    events = sse_payloads(chat(client, messages=messages, add_generation_prompt=False, continue_final_message=True,
                               echo=True, stream=True).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Sure:"}


def test_truncate_prompt_tokens_keeps_the_last_tokens(app):
    client, records, _ = app
    ok(completion(client, prompt=[5, 6, 7, 8, 9, 10], truncate_prompt_tokens=3))
    assert records[-1][0] == [8, 9, 10]


def test_max_tokens_zero_runs_the_prompt_only(app):
    client, records, _ = app
    body = ok(completion(client, max_tokens=0))
    assert records[-1][1].max_tokens == 0
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0


def test_min_tokens_holds_back_an_eos_the_model_wants(app):
    """min_tokens reaches the sampler (guidellm's test cannot show it: it also sends ignore_eos). EOS biased to
    win every greedy step ends the answer at once; with min_tokens it comes only after that many tokens."""
    client, records, engine = app
    eos = {"logit_bias": {str(engine.tokenizer.eos_token_id): 100}, "temperature": 0, "max_tokens": 12}
    alone = ok(completion(client, **eos))
    assert alone["choices"][0]["finish_reason"] == "stop" and alone["usage"]["completion_tokens"] < 6, alone
    held = ok(completion(client, min_tokens=6, **eos))
    assert held["choices"][0]["finish_reason"] == "stop", held           # its EOS, not max_tokens, ended it
    assert 6 <= held["usage"]["completion_tokens"] < 12, held
    assert records[-1][1].min_tokens == 6
    # As guidellm streams it (continuous usage stats), without its ignore_eos: the last usage counts them all.
    events = sse_payloads(completion(client, min_tokens=6, stream=True,
                                     stream_options={"continuous_usage_stats": True}, **eos).text)
    assert events[-1]["usage"]["completion_tokens"] >= 6, events[-1]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]


# ---- tools and tool_choice --------------------------------------------------------------------------------
def test_tool_choice_none_keeps_the_tools_out_of_the_template(app):
    """vLLM still renders the tools with tool_choice "none" (unless --exclude-tools-when-tool-choice-none);
    slora leaves them out, for tools and for the legacy functions alike."""
    client, records, engine = app
    for fields in ({"tools": [TOOL], "tool_choice": "none"},
                   {"functions": [TOOL["function"]], "function_call": "none"}):
        ok(chat(client, **fields))
        assert "tools=" not in engine.tokenizer.decode(records[-1][0]), fields
        assert records[-1][1].structured is None
    ok(chat(client, tools=[TOOL], tool_choice="auto"))
    assert "tools=" in engine.tokenizer.decode(records[-1][0])


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
CLOCK = {"type": "function", "function": {"name": "get_time"}}      # no parameters: its arguments are {}


@pytest.mark.parametrize("fields,schema", [
    ({"tools": [TOOL, CLOCK], "tool_choice": "required"},
     {"type": "array", "minItems": 1, "items": {"anyOf": [
         {"type": "object",
          "properties": {"name": {"const": "get_weather"}, "parameters": TOOL["function"]["parameters"]},
          "required": ["name", "parameters"], "additionalProperties": False},
         {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": NO_ARGUMENTS},
          "required": ["name", "parameters"], "additionalProperties": False}]}}),
    ({"tools": [CLOCK], "tool_choice": "required", "parallel_tool_calls": False},
     {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
         {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": NO_ARGUMENTS},
          "required": ["name", "parameters"], "additionalProperties": False}]}}),
    ({"tools": [CLOCK, TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     TOOL["function"]["parameters"]),
    ({"tools": [TOOL, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, NO_ARGUMENTS),
    ({"functions": [TOOL["function"]], "function_call": {"name": "get_weather"}}, TOOL["function"]["parameters"]),
], ids=["required", "required-one-call", "named", "named-without-parameters", "legacy-function_call"])
def test_a_forced_tool_choice_reaches_the_engine_as_a_json_schema(app, fields, schema):
    client, records, _ = app
    ok(chat(client, **fields))
    structured = records[-1][1].structured
    assert structured is not None and structured.kind == "json_schema"
    assert json.loads(structured.spec) == schema


def test_a_forced_call_is_answered_as_tool_calls_without_the_parser_flag(app):
    """This app has no --enable-auto-tool-choice: as in vLLM, a forced call needs none. The output is the
    tiny random model's, held to the schema."""
    client, _, _ = app
    body = ok(chat(client, tools=[TOOL, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                   max_tokens=64, seed=2))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    call, = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {}
    legacy = ok(chat(client, functions=[CLOCK["function"]], function_call={"name": "get_time"}, max_tokens=64,
                     seed=2))["choices"][0]
    assert legacy["finish_reason"] == "function_call", legacy
    assert legacy["message"]["function_call"] == {"name": "get_time", "arguments": "{}"}
    assert legacy["message"]["tool_calls"][0]["function"] == legacy["message"]["function_call"]


def test_a_forced_call_cut_short_is_returned_as_text(app):
    client, _, _ = app
    choice = ok(chat(client, tools=[TOOL], tool_choice="required", max_tokens=2))["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"], choice
    assert choice["message"]["content"].startswith("[")          # the schema's array, begun


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     ("tool_choice", "response_format")),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
     "response_format", ("tool_choice", "response_format")),
    ({"functions": [TOOL["function"]], "function_call": {"name": "get_weather"}, "guided_json": {"type": "object"}},
     "guided_json", ("function_call", "guided_json")),
    ({"tool_choice": "required"}, "tool_choice", ("needs tools",)),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     ("'get_time'", "not among")),
    ({"functions": [TOOL["function"]], "function_call": {"name": "get_time"}}, "function_call", ("'get_time'",)),
    ({"tools": [TOOL], "functions": [TOOL["function"]]}, "functions", ("tools", "functions")),
    ({"tools": [TOOL], "tool_choice": "auto", "function_call": "auto"}, "function_call", ("tool_choice",)),
], ids=["required+response_format", "named+json_schema", "function_call+guided_json", "required-without-tools",
        "named-unknown", "function_call-unknown", "tools+functions", "tool_choice+function_call"])
def test_tool_choice_conflicts_are_400_naming_them(app, fields, param, words):
    client, records, _ = app
    before = len(records)
    error = error_of(chat(client, **fields))
    assert error["param"] == param and all(word in error["message"] for word in words), error
    assert len(records) == before                       # refused before the engine saw it


# ---- structured output ---------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))
STRUCTURED = {
    "response_format-text": ({"response_format": {"type": "text"}}, None),
    "response_format-json_object": ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    "response_format-json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    "guided_json-object": ({"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    "guided_json-text": ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    "guided_regex": ({"guided_regex": "[ab]+"}, StructuredOutput("regex", "[ab]+")),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", ("yes", "no"))),
    "guided_grammar": ({"guided_grammar": 'root ::= "yes" | "no"'},
                       StructuredOutput("grammar", 'root ::= "yes" | "no"')),
    "structured_outputs-json": ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    "structured_outputs-regex": ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutput("regex", "[ab]+")),
    "structured_outputs-choice": ({"structured_outputs": {"choice": ["yes", "no"]}},
                                  StructuredOutput("choice", ("yes", "no"))),
    "structured_outputs-grammar": ({"structured_outputs": {"grammar": 'root ::= "yes"'}},
                                   StructuredOutput("grammar", 'root ::= "yes"')),
}


@pytest.mark.parametrize("route", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("case", sorted(STRUCTURED))
def test_structured_output_fields_reach_the_engine(app, route, case):
    client, records, _ = app
    fields, expected = STRUCTURED[case]
    before = len(records)
    response = route(client, temperature=0, **fields)
    assert len(records) == before + 1, response.text
    assert records[-1][1].structured == expected
    # The engine compiles the spec; these are valid ones, so the request is served.
    assert response.status_code == 200, response.text


def test_two_structured_output_fields_are_400_naming_both(app):
    client, _, _ = app
    error = error_of(completion(client, response_format={"type": "json_object"}, guided_regex="a+"))
    assert "response_format" in error["message"] and "guided_regex" in error["message"], error
    error = error_of(chat(client, guided_choice=["a"], structured_outputs={"regex": "a"}))
    assert "guided_choice" in error["message"] and "structured_outputs.regex" in error["message"], error


@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ({"guided_grammar": "this is not ebnf"}, "guided_grammar"),
])
def test_a_spec_the_engine_cannot_compile_is_400(app, fields, param):
    """Needs the engine side (slora/sampling/grammar.py compiling at add_request)."""
    client, _, engine = app
    error = error_of(completion(client, **fields))
    assert error["param"] == param, error
    assert engine.pool_stats()["kv_pages"] == 0           # nothing of it ran


def test_guided_json_that_is_not_a_schema_is_400(app):
    client, _, _ = app
    for value in ("[1, 2]", "{not json", 5):
        assert error_of(completion(client, guided_json=value))["param"] == "guided_json"


# ---- refused by name -----------------------------------------------------------------------------------
UNSUPPORTED = {     # field: a value slora does not implement (each field's neutral value is accepted)
    "suffix": "and then",
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True,
    "allowed_token_ids": [1, 2],
    "bad_words": ["bad"],
    "logits_processors": ["x"],
    "cache_salt": "salt",
    "guided_whitespace_pattern": " *",
    "prompt_embeds": "AAAA",
}
CHAT_UNSUPPORTED = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "chat_template": "{{ messages }}",
    "moderation": {"model": "omni"},
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_unimplemented_completion_fields_are_refused_by_name(app, field):
    client, _, _ = app
    error = error_of(completion(client, **{field: UNSUPPORTED[field]}))
    assert error["param"] == field and "not supported" in error["message"], error


@pytest.mark.parametrize("field", sorted(CHAT_UNSUPPORTED))
def test_unimplemented_chat_fields_are_refused_by_name(app, field):
    client, _, _ = app
    error = error_of(chat(client, **{field: CHAT_UNSUPPORTED[field]}))
    assert error["param"] == field and "not supported" in error["message"], error


def test_images_and_structural_tags_are_refused_by_name(app):
    client, _, _ = app
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    error = error_of(chat(client, messages=image))
    assert error["param"].startswith("messages.0.content") and "not supported" in error["message"], error
    error = error_of(chat(client, response_format={"type": "structural_tag", "structures": []}))
    assert error["param"] == "response_format.type" and "not supported" in error["message"], error
    error = error_of(chat(client, tools=[{"type": "custom", "custom": {"name": "x"}}]))
    assert error["param"].startswith("tools.0.type") and "not supported" in error["message"], error


# ---- bounds --------------------------------------------------------------------------------------------
def test_logit_bias_outside_the_vocabulary_is_400_naming_the_id(app):
    client, _, engine = app
    vocab = engine.model_config.vocab_size
    error = error_of(completion(client, logit_bias={str(vocab): 1, "5": 1}))
    assert error["param"] == "logit_bias" and str(vocab) in error["message"], error
    error = error_of(chat(client, logit_bias={"token": 1}))
    assert error["param"].startswith("logit_bias"), error
    error = error_of(completion(client, logit_bias={"5": 101}))
    assert error["param"].startswith("logit_bias"), error
    error = error_of(completion(client, logit_bias={str(i): 1 for i in range(1025)}))
    assert error["param"] == "logit_bias" and "1024" in error["message"], error


@pytest.mark.parametrize("fields,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 129}, "best_of"), ({"max_tokens": -1}, "max_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a" * (2 ** 18 + 1)}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_out_of_range_values_are_400_naming_the_field(app, fields, param):
    client, _, _ = app
    error = error_of(completion(client, **fields))
    assert error["param"] == param, error


@pytest.mark.parametrize("fields,param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [TOOL] * 129}, "tools"), ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not an identifier": 1}}, "chat_template_kwargs.not an identifier.[key]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
])
def test_out_of_range_chat_values_are_400_naming_the_field(app, fields, param):
    client, _, _ = app
    error = error_of(chat(client, **fields))
    assert error["param"] == param, error


def test_deeply_nested_json_is_refused(app):
    client, _, _ = app
    deep: object = {"type": "string"}
    for _ in range(80):
        deep = {"type": "object", "properties": {"a": deep}}
    error = error_of(completion(client, guided_json=deep))
    assert error["param"].startswith("guided_json") and "nested deeper" in error["message"], error
    error = error_of(chat(client, tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}]))
    assert error["param"].startswith("tools.0.function.parameters"), error


def test_streaming_with_best_of_above_n_is_400(app):
    client, _, _ = app
    error = error_of(completion(client, stream=True, best_of=3, n=1))
    assert error["param"] == "best_of" and "stream" in error["message"], error
    error = error_of(chat(client, stream=True, best_of=2))
    assert error["param"] == "best_of", error
    events = sse_payloads(completion(client, stream=True, best_of=2, n=2).text)   # best_of == n streams
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}


def test_prompt_logprobs_are_not_streamed(app):
    client, _, _ = app
    assert error_of(completion(client, stream=True, prompt_logprobs=1))["param"] == "prompt_logprobs"


def test_the_schema_documents_the_new_fields_and_answers():
    document = create_app(lambda: None).openapi()      # never started: the schema needs no engine
    schemas = document["components"]["schemas"]
    completion_fields = schemas["CompletionRequest"]["properties"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    assert {"logprobs", "echo", "best_of", "logit_bias", "guided_json", "structured_outputs", "prompt_logprobs",
            "min_p", "repetition_penalty", "response_format"} <= set(completion_fields)
    assert {"tools", "tool_choice", "top_logprobs", "chat_template_kwargs", "continue_final_message", "store",
            "web_search_options"} <= set(chat_fields)
    assert schemas["CompletionRequest"]["additionalProperties"] is True       # unknown fields are ignored
    assert "CompletionLogprobs" in json.dumps(schemas["CompletionChoice"]["properties"]["logprobs"])
    assert "ChatLogprobs" in json.dumps(schemas["ChatChoice"]["properties"]["logprobs"])
