"""The engine's CUDA-path wiring (Triton attention and LoRA backends) run through the Triton interpreter
on the CPU: same greedy tokens as the reference backends, for a mixed-adapter batch with prefill and
decode steps. (CUDA graphs need a GPU: tests/e2e/test_gpu_engine.py.)"""
import os

import pytest
import torch

from slora import LLM, SamplingParams
from slora import attention_backend
from slora.attention_backend import TritonAttention, TritonLora
from slora.cuda_graphs import GraphLimits
from slora.model_runner import step_max_rank
from tiny import random_prompts

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs Triton kernels in the interpreter, on CPU-only machines")


@pytest.mark.parametrize("accumulate_max_tokens,fused", [(64, False), (0, False), (64, True)])
def test_triton_backends_match_the_reference_backends(tiny_llama, monkeypatch, accumulate_max_tokens, fused):
    """Shrink into one h or split partial sums; fused: every step runs lora_fused where LoraBatch.apply
    allows it (the CUDA engine does so only in decode graphs with few adapters)."""
    monkeypatch.setattr(attention_backend, "ACCUMULATE_MAX_TOKENS", accumulate_max_tokens)
    if fused:
        prepare = TritonLora.prepare
        monkeypatch.setattr(TritonLora, "prepare", lambda self, slots, n, layers, fused=False:
                            prepare(self, slots, n, layers, fused=True))
    prompts = random_prompts([3, 18, 9], seed=40)
    names = ["all-r16", None, "rs-pattern"]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = []
    for triton in (False, True):
        llm = LLM(str(tiny_llama.model_dir), num_pages=64)
        for name in ("all-r16", "rs-pattern"):
            llm.load_adapter(name, str(tiny_llama.adapters[name]))
        if triton:
            llm.engine.runner.attention, llm.engine.runner.lora_ops = TritonAttention(), TritonLora()
        outputs.append([o.token_ids for o in llm.generate(prompts, params, adapters=names)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("triton", [False, True])
def test_warm_up_writes_nothing_and_leaves_generation_unchanged(tiny_llama, triton):
    """The CUDA engine's start-up warm-up (prefill and mixed-step kernel variants, adapters at rank 0)
    must not touch the pool: a pool holding KV and adapter pages is the same after it, and greedy tokens
    generated after it are those generated before."""
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    runner = llm.engine.runner
    if triton:
        runner.attention, runner.lora_ops = TritonAttention(), TritonLora()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = random_prompts([7, 12], seed=41)
    before = [o.token_ids for o in llm.generate(prompts, params, adapters=["all-r16", None])]
    pool = runner.pool.clone()
    runner.warm_up(_limits_for(llm))
    assert torch.equal(runner.pool, pool)
    assert [o.token_ids for o in llm.generate(prompts, params, adapters=["all-r16", None])] == before


def _limits_for(llm: LLM) -> GraphLimits:
    """The graph limits a CUDA engine of this model would use (a CPU engine has none)."""
    engine = llm.engine
    rank = engine.config.max_lora_rank
    return GraphLimits(max_batch=4, max_blocks=8, max_adapter_pages=4, max_lora_rank=rank,
                       num_layers=engine.model_config.num_layers)


@pytest.mark.parametrize("highest,expected", [(0, 0), (1, 16), (8, 16), (16, 16), (17, 32), (64, 64), (65, 80)])
def test_step_max_rank_is_a_multiple_of_16(highest, expected):
    """Triton specialises ints on divisibility by 16: steps of rank-8 and rank-16 adapters must give the
    LoRA kernels the same kind of max_rank, or each compiles its own variant while serving."""
    assert step_max_rank(highest) == expected
