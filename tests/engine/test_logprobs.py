"""Logprobs of sampled and prompt tokens equal log_softmax of transformers' logits (float32, CPU), also
after chunked prefill, on an adapter, with the prefix cache warm, and for a prompt alone (max_tokens=0)."""
import os

import pytest
import torch
from tiny import make_adapters, make_model, random_prompts, record_attention

from slora import LLM, SamplingParams

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    model_dir = make_model(root)
    return model_dir, make_adapters(model_dir, root, ["all-r16"])


@torch.inference_mode()
def reference_logprobs(model_dir, tokens: list[int], adapter=None) -> torch.Tensor:
    """log_softmax of transformers' (+ PEFT's) logits at every position of `tokens`: `[len, vocab]`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    return torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_position(found, want_row: torch.Tensor, token: int, k: int) -> None:
    assert found.token_id == token
    assert abs(found.logprob - want_row[token].item()) < TOLERANCE
    assert found.rank == int((want_row > want_row[token]).sum()) + 1
    top = want_row.topk(k)
    assert [t for t, _ in found.top] == top.indices.tolist()
    assert all(abs(v - w) < TOLERANCE for (_, v), w in zip(found.top, top.values.tolist()))


@pytest.mark.parametrize("adapter", [None, "all-r16"])
@pytest.mark.parametrize("chunk", [256, 16])          # 16: the 40-token prompt prefills in three chunks
def test_sampled_and_prompt_logprobs_match_transformers(model, adapter, chunk):
    model_dir, adapters = model
    llm = LLM(str(model_dir), page_size=8, max_num_batched_tokens=chunk, max_num_seqs=4)
    if adapter:
        llm.load_adapter(adapter, str(adapters[adapter]))
    prompt = random_prompts([40], seed=3)[0]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], params, adapters=[adapter])[0]
    want = reference_logprobs(model_dir, prompt + out.token_ids, adapters.get(adapter) if adapter else None)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        assert_position(out.prompt_logprobs[p], want[p - 1], prompt[p], 2)
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids) == 5
    for i, token in enumerate(sample.token_ids):
        assert_position(sample.logprobs[i], want[len(prompt) - 1 + i], token, 3)
        assert sample.logprobs[i].rank == 1                            # greedy takes the best token
    assert abs(sample.cumulative_logprob - sum(lp.logprob for lp in sample.logprobs)) < 1e-9
    assert llm.pool_stats()["kv_pages"] == 0


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_prompt_logprob_row_attended_as_a_decode_query_matches_transformers(model, monkeypatch, backend):
    """A 2-token prompt that asks for prompt logprobs, beside a 40-token prompt's first chunk that samples no
    row: the step samples 2 rows for 2 sequences, so its last layer attends those rows alone (attend_rows), and
    one of them is a prompt-logprob row inside a sequence, not at its end. Its logprobs are transformers'."""
    from slora.execution.attention_backend import ReferenceAttention, TritonAttention
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on the CPU run in the interpreter")
    model_dir, _ = model
    backend_class = TritonAttention if backend == "triton" else ReferenceAttention
    attended = record_attention(monkeypatch, backend_class)
    llm = LLM(str(model_dir), page_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    llm.engine.runner.attention = backend_class()
    short, long = random_prompts([2, 40], seed=11)
    with_logprobs = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate([short, long], [with_logprobs, SamplingParams(max_tokens=2, temperature=0)])
    # The first step, 2 + 14 tokens: the first layer attends them all, the last only the short prompt's 2 rows.
    assert attended[:2] == [("all", 16), ("rows", 2)]
    want = reference_logprobs(model_dir, short + outputs[0].token_ids)
    assert_position(outputs[0].prompt_logprobs[1], want[0], short[1], 3)
    for prompt, output in zip((short, long), outputs):     # greedy: each token is transformers' best next one
        want = reference_logprobs(model_dir, prompt + output.token_ids)
        assert output.token_ids == want[len(prompt) - 1:-1].argmax(dim=-1).tolist()


def test_prompt_alone_with_a_warm_prefix_cache(model):
    """max_tokens=0: the prompt's logprobs and no token. The same prompt cached by an earlier request must
    still give every position's logprob (the cache holds no logits)."""
    model_dir, _ = model
    llm = LLM(str(model_dir), page_size=8, enable_prefix_caching=True)
    prompt = random_prompts([33], seed=4)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))          # warms the cache
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    want = reference_logprobs(model_dir, prompt)
    assert out.num_cached_tokens == 0
    for p in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[p].logprob - want[p - 1, prompt[p]].item()) < TOLERANCE
        assert out.prompt_logprobs[p].top == []
    assert llm.pool_stats()["kv_pages"] == 0


def test_no_logprobs_unless_asked(model):
    model_dir, _ = model
    llm = LLM(str(model_dir))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(model):
    """best_of=4, n=2: four samples run; the two returned are the best two of the four, best first, as
    each sample's seed (seed + i) run alone with logprobs shows."""
    model_dir, _ = model
    llm = LLM(str(model_dir))
    prompt = random_prompts([9], seed=5)[0]
    best = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, best_of=4,
                                                 ignore_eos=True))[0]
    alone = [llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, ignore_eos=True,
                                                   logprobs=0))[0].outputs[0] for i in range(4)]
    ranked = sorted(alone, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert llm.pool_stats()["kv_pages"] == 0
