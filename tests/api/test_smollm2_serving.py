"""`slora serve` of the default model, SmolLM2-135M-Instruct, through the official openai client: chat with
its own template, streaming, n > 1, stop strings, its shared system prompt from the prefix cache, and its
demo adapters (built in, and one hot-loaded through the API), each equal to the offline engine."""
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import start_server

from slora import SamplingParams
from slora.models.builtin import DEFAULT_MODEL, resolve_model

DEMO_ADAPTERS = ["demo-pirate", "demo-caps", "demo-json"]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 32
PAGE_SIZE = 16          # the server's default: whole pages are shared


@pytest.fixture(scope="module")
def server(shared_server):
    """No --model: the default. The session's one such server, tests/clients' too (no test there depends on
    this module's requests, nor any here on a fresh server: the prefix cache is asked about two questions that
    none of them sends)."""
    return shared_server(start_server, model=None)


def ask(client, model: str, question: str = QUESTION, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def test_models_are_the_default_and_its_demo_adapters(client):
    assert {DEFAULT_MODEL, *DEMO_ADAPTERS} <= {m.id for m in client.models.list()}


def test_a_mix_of_base_and_adapter_chats_equals_the_offline_replies(client, smollm2):
    models = [DEFAULT_MODEL, *DEMO_ADAPTERS]
    with ThreadPoolExecutor(len(models)) as pool:          # sent together, so that they share batches
        replies = list(pool.map(lambda model: ask(client, model), models))
    adapters = [None if model == DEFAULT_MODEL else model for model in models]
    conversation = [{"role": "user", "content": QUESTION}]
    offline = smollm2.chat([conversation] * len(models), SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           adapters)                                    # one batch, as the server ran them
    for model, reply, expected in zip(models, replies, offline):
        assert reply.choices[0].message.content == expected.text, model
    assert "Paris" in replies[0].choices[0].message.content
    assert len({r.choices[0].message.content for r in replies}) == len(models)   # each adapter differs


def test_streamed_chat_is_the_whole_reply_in_pieces(client):
    whole = ask(client, "demo-pirate").choices[0].message.content
    chunks = list(ask(client, "demo-pirate", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_several_sampled_choices_are_reproducible_with_a_seed(client):
    def sample():
        reply = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=12, temperature=0.9, seed=7, n=3,
                                               messages=[{"role": "user", "content": "Tell me about cats."}])
        return [choice.message.content for choice in reply.choices]

    first = sample()
    assert len(first) == 3 and all(first) and first == sample()


def test_a_stop_string_ends_the_reply_before_it(client):
    reply = ask(client, DEFAULT_MODEL, stop=["Paris"]).choices[0]
    assert reply.finish_reason == "stop" and reply.message.content == "The capital of France is "


def test_the_templates_system_prompt_comes_from_the_prefix_cache(client, smollm2):
    first, second = "What is the capital of Spain?", "What is the capital of Peru?"
    ask(client, DEFAULT_MODEL, first)
    usage = ask(client, DEFAULT_MODEL, second).usage
    ids = [smollm2.chat_prompt_ids([{"role": "user", "content": q}]) for q in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)    # the system prompt and more
    assert usage.prompt_tokens_details.cached_tokens == shared // PAGE_SIZE * PAGE_SIZE > 0


def test_an_adapter_uploaded_through_the_api_answers_as_the_demo_does(http, client):
    folder = resolve_model(DEFAULT_MODEL).demo_adapters["demo-pirate"]
    files = {name: (path.name, path.read_bytes()) for name, path in
             (("adapter_config", folder / "adapter_config.json"),
              ("adapter_model", folder / "adapter_model.safetensors"))}
    response = http.post("/v1/adapters", data={"name": "my-pirate"}, files=files)
    assert response.status_code == 200, response.text
    assert ask(client, "my-pirate").choices[0].message.content == ask(client, "demo-pirate").choices[0].message.content
