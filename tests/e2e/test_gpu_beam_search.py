"""Beam search on the CUDA path (Triton kernels, decode and mixed-step graphs, overlapped scheduling): the same
beams as transformers' beam search + PEFT in float32, mixed with plain requests and adapters."""
import pytest
import torch
from tiny import oracle_beam_search, oracle_greedy, random_prompts

from slora import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_beams_on_graphs_equal_transformers_in_float32(tiny_llama):
    prompts = random_prompts([5, 17, 40, 100], seed=21)
    names = [None, "attn-r4", "all-r16", None]
    llm = LLM(str(tiny_llama.model_dir), device="cuda", dtype="float32", num_pages=1024, max_num_seqs=32)
    for name, path in tiny_llama.adapters.items():
        llm.load_adapter(name, str(path))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.mixed_graphs is not None
    beam = SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=12, ignore_eos=True, stop_token_ids=[1])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, [beam, greedy, beam, greedy], adapters=names)
    for index in (0, 2):
        want = oracle_beam_search(tiny_llama.model_dir, tiny_llama.adapters, prompts[index], names[index], width=4,
                                  max_new_tokens=12, stop_token_ids=[1], n=2)
        assert [c.token_ids for c in outputs[index].outputs] == want
    plain = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, [prompts[1], prompts[3]], [names[1], names[3]],
                          8)
    assert [outputs[1].outputs[0].token_ids, outputs[3].outputs[0].token_ids] == plain
    llm.engine.check()
    assert llm.engine.pool_stats()["kv_pages"] == 0
