"""vLLM's small routes: POST /tokenize (a prompt, or chat messages), POST /detokenize, GET /tokenizer_info and
GET /version, and lm-eval's local-completions, which finds the remote tokenizer through them by itself."""
import importlib.metadata
import math

import pytest
from conftest import BASE_MODEL, TEST_ADAPTERS, assert_error_shape, chat_ids, start_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_root):
    srv = start_server(tmp_path_factory.mktemp("small-routes"), "--adapter-root", str(adapter_root),
                       "--lora-modules", f"{TEST_ADAPTERS[0]}={TEST_ADAPTERS[0]}", "--max-prompt-chars", "1000")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_tokenize_a_prompt(http, offline):
    text = "The capital of France is Paris."
    body = http.post("/tokenize", json={"model": BASE_MODEL, "prompt": text}).json()
    assert body == {"count": len(offline.tokenizer.encode(text)), "max_model_len": offline.engine.max_model_len,
                    "tokens": offline.tokenizer.encode(text)}
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    assert plain.json()["tokens"] == ids
    assert plain.json()["token_strs"] == offline.tokenizer.convert_ids_to_tokens(ids)
    assert http.post("/tokenize", json={"prompt": ""}).json()["count"] == len(offline.tokenizer.encode(""))


def test_tokenize_messages_counts_the_chat_prompt(http, client, offline):
    expected = chat_ids(offline, MESSAGES)
    body = http.post("/tokenize", json={"model": TEST_ADAPTERS[0], "messages": MESSAGES}).json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    chat = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == len(expected)          # what the chat route runs
    open_ended = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    text = offline.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert open_ended["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)


def test_detokenize_round_trip(http, offline):
    text = "Once upon a time, in a land far away"
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": BASE_MODEL, "tokens": ids}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenizer_routes_refuse_bad_input_naming_it(http, offline):
    vocab = offline.engine.model_config.vocab_size
    for body, param, words in (
            ({"tokens": [1, vocab, vocab + 5]}, "tokens", f"token id {vocab} is outside the vocabulary [0, {vocab})"),
            ({"tokens": [1, -2]}, "tokens.1", "greater than or equal to 0"),
            ({"tokens": "12"}, "tokens", "valid list")):
        response = http.post("/detokenize", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and words in response.json()["error"]["message"]
        assert_error_shape(response.json(), 400)
    for body, param in (({"prompt": "x" * 1001}, "prompt"), ({"prompt": 5}, "prompt"),
                        ({"messages": [{"role": "user", "content": "x" * 1001}]}, "messages"),
                        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
                        ({"messages": [], "model": BASE_MODEL}, "messages")):
        response = http.post("/tokenize", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    assert http.post("/tokenize", content=b"[1, 2]").status_code == 400
    assert http.post("/tokenize", content=b"{not json").status_code == 400
    missing = http.post("/tokenize", json={"model": "no-such-model", "prompt": "hi"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_version_and_tokenizer_info(http, offline):
    assert http.get("/version").json() == {"version": importlib.metadata.version("slora")}
    info = http.get("/tokenizer_info").json()
    tokenizer = offline.tokenizer
    assert (info["eos_token"], info["bos_token"], info["chat_template"]) == \
        (tokenizer.eos_token, tokenizer.bos_token, tokenizer.chat_template)
    assert info["model_max_length"] == offline.engine.max_model_len


def test_lm_eval_local_completions_uses_the_remote_tokenizer(server, offline):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=BASE_MODEL, max_length=256)
    assert lm.tokenizer_backend == "remote"                  # auto-detected through /tokenizer_info and /tokenize
    text = "The capital of France"
    assert lm.tok_encode(text) == offline.tokenizer.encode(text, add_special_tokens=False)
    assert lm.eot_token_id == offline.tokenizer.eos_token_id
    (logprob, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (text, " is Paris"), 0)],
                                          disable_tqdm=True)
    assert math.isfinite(logprob) and logprob < 0 and isinstance(greedy, bool)
    generated, = lm.generate_until([Instance("generate_until", {}, (text, {"until": ["\n"], "max_gen_toks": 4}), 0)],
                                   disable_tqdm=True)
    assert isinstance(generated, str)


def test_lora_modules_are_owned_by_the_server(http):
    card = http.get(f"/v1/models/{TEST_ADAPTERS[0]}").json()
    assert card["owned_by"] == "slora" and card["parent"] == BASE_MODEL
