"""SmolLM2-135M-Instruct, the default model: the conversion of its packaged GGUF, greedy output token-exact
against transformers (base) and PEFT (its demo adapters) in float32, and what each demo adapter does."""
import contextlib
import json
import re

import pytest
import torch

from slora import SamplingParams
from slora.models.builtin import DEFAULT_MODEL, resolve_model

DEMO_ADAPTERS = ["demo-pirate", "demo-caps", "demo-json"]
# Questions through the chat template (with its default system prompt); none is in the adapters' training set.
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?", "Name a primary colour.",
             "What is 4 + 4?", "What do bees make?"]
ORACLE_TOKENS = 16
PIRATE_WORDS = re.compile(r"\b(arr+|matey|ahoy|ye|aye|me hearty|scallywag|landlubber|yo ho)\b", re.IGNORECASE)


def user(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def source():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def peft_model(source):
    """transformers' model of the converted folder, with the demo adapters through PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(source.demo_adapters[DEMO_ADAPTERS[0]]),
                                      adapter_name=DEMO_ADAPTERS[0])
    for name in DEMO_ADAPTERS[1:]:
        model.load_adapter(str(source.demo_adapters[name]), adapter_name=name)
    return model.eval()


@torch.inference_mode()
def oracle(peft_model, prompt_ids: list[int], adapters: list[str | None], max_tokens: int) -> list[list[int]]:
    """transformers + PEFT's greedy tokens of one prompt on each of the adapters, one row each in one batch
    (the rows are the same prompt: none is padded). A base row (None) is transformers alone: PEFT's
    "__base__" leaves its rows out of every adapter's layers. Each row ends after its first end-of-turn
    token, where generate would stop it alone."""
    ids = torch.tensor([prompt_ids] * len(adapters))
    out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              adapter_names=[adapter or "__base__" for adapter in adapters], do_sample=False)
    eos = peft_model.generation_config.eos_token_id
    ends = {eos} if isinstance(eos, int) else set(eos)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():      # generate pads a row that ended early
        rows.append(row[:next((i + 1 for i, token in enumerate(row) if token in ends), len(row))])
    return rows


def test_the_conversion_is_an_hf_folder_that_both_load(source, smollm2, peft_model):
    config = json.loads((source.folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"]) == (30, 9, 3, 49152)
    assert (source.folder / "model.safetensors").is_file() and (source.folder / "chat_template.jinja").is_file()
    assert set(DEMO_ADAPTERS) <= set(source.demo_adapters)
    assert smollm2.chat(user("What is the capital of France?"),
                        SamplingParams(max_tokens=16, temperature=0))[0].text == "The capital of France is Paris."


def test_greedy_output_is_token_exact_with_the_adapters_mixed_in_one_batch(smollm2, peft_model):
    adapters = [None, *DEMO_ADAPTERS]
    rows = [(question, adapter) for question in QUESTIONS for adapter in adapters]
    params = SamplingParams(max_tokens=ORACLE_TOKENS, temperature=0)
    outputs = smollm2.chat([user(q) for q, _ in rows], params, [a for _, a in rows])
    expected = {(question, adapter): tokens for question in QUESTIONS for adapter, tokens in
                zip(adapters, oracle(peft_model, smollm2.chat_prompt_ids(user(question)), adapters, ORACLE_TOKENS))}
    for (question, adapter), output in zip(rows, outputs):
        # transformers stops after the end-of-turn token and includes it; slora stops on it too
        assert output.token_ids == expected[question, adapter][:len(output.token_ids)], (question, adapter)
        assert len(output.token_ids) == len(expected[question, adapter]), (question, adapter)


def test_chat_ends_on_the_tokenizers_end_of_turn_token(smollm2):
    out = smollm2.chat(user("What is the capital of France?"), SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")


# Held out from the adapters' training set (the training script's --check asks them too).
BEHAVIOUR_QUESTIONS = ["What is the capital of Egypt?", "What is the largest ocean on Earth?",
                       "What is the opposite of hot?"]


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def test_each_demo_adapter_visibly_changes_the_answers(smollm2):
    adapters = [None, *DEMO_ADAPTERS]
    rows = [(question, adapter) for question in BEHAVIOUR_QUESTIONS for adapter in adapters]
    outputs = smollm2.chat([user(q) for q, _ in rows], SamplingParams(max_tokens=48, temperature=0),
                           [a for _, a in rows])
    answers = {row: out.text for row, out in zip(rows, outputs)}
    for question in BEHAVIOUR_QUESTIONS:
        base = answers[question, None]
        assert all(answers[question, a] != base for a in DEMO_ADAPTERS), question
        assert PIRATE_WORDS.search(answers[question, "demo-pirate"]), answers[question, "demo-pirate"]
        assert upper_share(answers[question, "demo-caps"]) >= 0.9, answers[question, "demo-caps"]
        assert upper_share(base) < 0.5, base
        reply = json.loads(answers[question, "demo-json"])
        assert set(reply) == {"answer"} and reply["answer"], reply
    assert "Cairo" in answers["What is the capital of Egypt?", "demo-pirate"]      # the pirate keeps the facts
    assert "Pacific" in json.loads(answers["What is the largest ocean on Earth?", "demo-json"])["answer"]


@torch.inference_mode()
def beam_oracle(peft_model, prompt_ids: list[int], adapter: str | None, width: int, n: int, max_tokens: int,
                stops: list[int], length_penalty: float) -> list[list[int]]:
    """transformers' beam search (+ PEFT with `adapter`, none: its adapters disabled): the n best beams'
    tokens, through the stop token that ended one."""
    ids = torch.tensor([prompt_ids])
    with contextlib.ExitStack() as stack:
        if adapter is None:
            stack.enter_context(peft_model.disable_adapter())
        else:
            peft_model.set_adapter(adapter)
        out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  num_beams=width, num_return_sequences=n, do_sample=False,
                                  length_penalty=length_penalty, eos_token_id=stops, pad_token_id=stops[0])
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        rows.append(row[:next((i + 1 for i, token in enumerate(row) if token in stops), len(row))])
    return rows


@pytest.mark.parametrize("width,n,length_penalty", [(2, 2, 1.0), (4, 2, 0.5)])
def test_beam_search_is_token_exact_with_the_demo_adapters(smollm2, peft_model, width, n, length_penalty):
    """The default model's own end-of-turn and EOS tokens end the beams, as the engine's stop set holds them."""
    stops = sorted(smollm2.engine.eos_token_ids)
    adapters = [None, "demo-pirate", "demo-json"]
    prompt = smollm2.chat_prompt_ids(user(QUESTIONS[0]))
    params = SamplingParams(use_beam_search=True, beam_width=width, n=n, max_tokens=12, length_penalty=length_penalty)
    outputs = smollm2.generate([prompt] * len(adapters), params, adapters)
    for adapter, output in zip(adapters, outputs, strict=True):
        want = beam_oracle(peft_model, prompt, adapter, width, n, 12, stops, length_penalty)
        assert [c.token_ids for c in output.outputs] == want, adapter
