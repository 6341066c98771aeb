"""An FP8 KV cache on the CUDA path (Triton kernels, decode and mixed-step graphs, overlapped scheduling) against
the CPU engine's references and transformers + PEFT attending over K and V quantized the same way."""
import gc
import json

import pytest
import torch
from tiny import fp8_kv_attention, oracle_greedy, random_prompts

from slora import LLM, SamplingParams
from slora.config import CudaConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NAMES = ["attn-r4", None, "mlp-r8", "all-r16", "rs-pattern", None, "all-r16", "attn-r4"]
# [layers, 2, kv_heads] powers of two, different by layer, K or V, and head (the tiny model: 2 layers, 2 KV heads)
SCALES = torch.exp2(torch.tensor([[[-6.0, -5.0], [-7.0, -6.0]], [[-5.0, -6.0], [-6.0, -4.0]]]))


@pytest.fixture(scope="module")
def scales_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "scales.json"
    path.write_text(json.dumps({"k_scale": SCALES[:, 0].tolist(), "v_scale": SCALES[:, 1].tolist()}))
    return str(path)


def fp8_llm(setup, scales_file, **kwargs) -> LLM:
    llm = LLM(str(setup.model_dir), num_pages=1024, max_num_seqs=16, kv_cache_dtype="fp8",
              kv_cache_scales=scales_file, **kwargs)
    for name, path in setup.adapters.items():
        llm.load_adapter(name, str(path))
    return llm


def tokens(llm: LLM, prompts, names, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, adapters=names)]


def test_fp8_graphs_match_the_cpu_engine_and_peft_in_float32(tiny_llama, scales_file):
    """Decode graphs, mixed-step graphs (prompts under 512 tokens) and eager steps (the 600-token prompt)."""
    prompts = random_prompts([1, 9, 16, 17, 40, 100, 600, 64], seed=11)
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts, NAMES, GREEDY.max_tokens,
                             fp8_kv_attention(SCALES))
    cpu = tokens(fp8_llm(tiny_llama, scales_file), prompts, NAMES)
    gpu = fp8_llm(tiny_llama, scales_file, device="cuda", dtype="float32")
    assert gpu.engine.runner.graphs is not None and gpu.engine.runner.mixed_graphs is not None
    assert tokens(gpu, prompts, NAMES) == cpu == expected
    gpu.engine.check()


def test_bf16_skip_layers_graphs_track_eager(tiny_llama, scales_file):
    """A skip layer's K and V in two halves of its memory (16-bit) beside FP8 layers, through the graphs.
    Skip layers need 16-bit weights on CUDA, and in bfloat16 a decode graph (split over its table's whole
    width) and an eager step (split over the longest context) sum attention in another order, so tokens may
    part after a near tie: on an H100 32 of 40 agreed (40 of 40 without skip layers, these prompts). A skip
    layer read through the wrong strides would part at once. The first tokens come of one eager step in both."""
    prompts = random_prompts([9, 17, 40, 100, 600], seed=14)
    names = NAMES[:5]
    graphs = fp8_llm(tiny_llama, scales_file, device="cuda", kv_cache_dtype_skip_layers="0")
    eager = fp8_llm(tiny_llama, scales_file, device="cuda", kv_cache_dtype_skip_layers="0",
                    cuda=CudaConfig(enforce_eager=True))
    on_graphs, on_eager = tokens(graphs, prompts, names), tokens(eager, prompts, names)
    assert [t[0] for t in on_graphs] == [t[0] for t in on_eager]
    same = sum(a == b for one, other in zip(on_graphs, on_eager) for a, b in zip(one, other))
    assert same >= 0.7 * sum(map(len, on_eager)), (on_graphs, on_eager)
    graphs.engine.check()


def test_fp8_eager_steps_match_graphs(tiny_llama, scales_file):
    prompts = random_prompts([5, 12, 30, 7, 22], seed=12)
    graphs = fp8_llm(tiny_llama, scales_file, device="cuda", dtype="float32")
    eager = fp8_llm(tiny_llama, scales_file, device="cuda", dtype="float32", cuda=CudaConfig(enforce_eager=True))
    for mix in (["all-r16"] * 5, [None, "rs-pattern", "attn-r4", None, "mlp-r8"]):
        assert tokens(graphs, prompts, mix) == tokens(eager, prompts, mix)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fp8_preemption_on_cuda_keeps_the_tokens(tiny_llama, scales_file, mode):
    prompts = random_prompts([30, 45, 20, 38, 27, 50], seed=25)
    names = ["attn-r4", None] * 3
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    roomy = fp8_llm(tiny_llama, scales_file, device="cuda", dtype="float32")
    tight = LLM(str(tiny_llama.model_dir), device="cuda", dtype="float32", num_pages=36, page_size=8,
                watermark=0.0, preemption_mode=mode, swap_space_gib=0.01, enable_prefix_caching=False,
                kv_cache_dtype="fp8", kv_cache_scales=scales_file, max_num_seqs=16)
    tight.load_adapter("attn-r4", str(tiny_llama.adapters["attn-r4"]))
    assert tokens(tight, prompts, names, params) == tokens(roomy, prompts, names, params)
    assert tight.engine.scheduler.num_preemptions > 0
    tight.engine.check()


def capacity_and_first_tokens(model_dir, prompts, **kwargs) -> tuple[int, list[int]]:
    """One engine sized by gpu_memory_utilization 0.2, alone: its budget is that share of the GPU less what
    this process holds, so the engines of earlier tests go back to the device first (the caching allocator
    keeps freed blocks otherwise)."""
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(model_dir), device="cuda", gpu_memory_utilization=0.2, **kwargs)
    capacity = llm.pool_stats()["kv_token_capacity"]
    firsts = [t[0] for t in tokens(llm, prompts, [None] * len(prompts))]
    llm.close()
    return capacity, firsts


def test_bf16_with_fp8_cache_holds_twice_the_tokens_and_tracks_bf16(tiny_llama):
    """Calibrated scales on the GPU; at the same memory share, twice the pages of the 16-bit cache."""
    prompts = random_prompts([9, 40, 100], seed=13)
    sixteen, sixteen_firsts = capacity_and_first_tokens(tiny_llama.model_dir, prompts)
    eight, eight_firsts = capacity_and_first_tokens(tiny_llama.model_dir, prompts, kv_cache_dtype="fp8")
    assert 1.95 < eight / sixteen < 2.05
    assert eight_firsts == sixteen_firsts
