"""An FP8 KV cache (DESIGN §2): greedy tokens equal transformers + PEFT attending over K and V quantized the same
way (float32, CPU), with adapters, chunked prefill, prefix sharing, forks and preemption; the same bytes hold
twice the pages of a 16-bit cache; scales come calibrated, from a checkpoint or from a file."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import fp8_kv_attention, make_adapters, make_model, oracle_greedy, random_prompts

from slora import LLM, SamplingParams
from slora.config import EngineConfig
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler
from slora.core.simulator import SimRequest, simulate
from slora.execution.pool_memory import PoolShape
from slora.kv_scales import calibration_prompts

LENGTHS = [1, 7, 16, 17, 40, 64, 130]
NAMES = [None, "attn-r4", "all-r16", None, "all-r16", "attn-r4", None]
NEW_TOKENS = 6
LAYERS, KV_HEADS = 2, 2
# Powers of two that differ by layer, K or V, and head: [layers, 2, kv_heads]. The tiny model's |K| and |V| reach
# about 7, so the smallest scales saturate some values at 448 * scale: the oracle must clamp as the cache does.
SCALES = torch.exp2(torch.tensor([[[-6.0, -5.0], [-7.0, -6.0]], [[-5.0, -6.0], [-6.0, -4.0]]]))


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    model_dir = make_model(root)
    adapters = make_adapters(model_dir, root, ["attn-r4", "all-r16"])
    scales_file = root / "scales.json"
    scales_file.write_text(json.dumps({"k_scale": SCALES[:, 0].tolist(), "v_scale": SCALES[:, 1].tolist()}))
    prompts = random_prompts(LENGTHS, seed=5)
    expected = oracle_greedy(model_dir, adapters, prompts, NAMES, NEW_TOKENS, fp8_kv_attention(SCALES))
    plain = oracle_greedy(model_dir, adapters, prompts, NAMES, NEW_TOKENS)
    assert expected != plain, "the quantized cache should change some tokens of the tiny model"
    return model_dir, adapters, scales_file, prompts, expected


def fp8_llm(fp8, names: tuple[str, ...] = ("attn-r4", "all-r16"), **options) -> LLM:
    model_dir, adapters, scales_file, *_ = fp8
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", kv_cache_scales=str(scales_file), **options)
    for name in names:
        llm.load_adapter(name, str(adapters[name]))
    return llm


def greedy(max_tokens: int = NEW_TOKENS, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **options)


@pytest.mark.parametrize("step_tokens", [2048, 48])
def test_fp8_cache_matches_peft_over_quantized_kv(fp8, step_tokens):
    """48 tokens a step: long prompts are chunked, each chunk attending over the quantized pages before it."""
    *_, prompts, expected = fp8
    llm = fp8_llm(fp8, max_num_batched_tokens=step_tokens, page_size=8)
    outputs = llm.generate(prompts, greedy(), adapters=NAMES)
    assert [o.token_ids for o in outputs] == expected
    assert torch.equal(llm.engine.runner.memory.kv_scales.cpu(), SCALES)
    llm.engine.check()


def test_skip_layers_keep_their_kv_in_the_model_dtype(fp8):
    model_dir, adapters, scales_file, prompts, _ = fp8
    expected = oracle_greedy(model_dir, adapters, prompts, NAMES, NEW_TOKENS,
                             fp8_kv_attention(SCALES, frozenset({1})))
    llm = fp8_llm(fp8, kv_cache_dtype_skip_layers="1")
    assert [o.token_ids for o in llm.generate(prompts, greedy(), adapters=NAMES)] == expected
    llm.engine.check()


@pytest.fixture(scope="module")
def tight_run(fp8):
    """Six prompts that outgrow a pool of 45 pages of 8 tokens, with an adapter on half, and PEFT's tokens."""
    model_dir, adapters, *_ = fp8
    prompts, names = random_prompts([30, 45, 20, 38, 27, 50], seed=25), ["attn-r4", None] * 3
    return prompts, names, oracle_greedy(model_dir, adapters, prompts, names, 16, fp8_kv_attention(SCALES))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_come_back_to_the_same_tokens(fp8, tight_run, mode):
    prompts, names, expected = tight_run
    llm = fp8_llm(fp8, ("attn-r4",), num_pages=45, page_size=8, watermark=0.0, preemption_mode=mode,
                  swap_space_gib=0.01, enable_prefix_caching=False)
    outputs = llm.generate(prompts, greedy(16), adapters=names)
    assert llm.engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert llm.engine.scheduler.num_swaps > 0
    assert [o.token_ids for o in outputs] == expected
    llm.engine.check()


def test_prefix_hits_and_forks_read_the_shared_quantized_pages(fp8):
    model_dir, adapters, _, _, _ = fp8
    prefix = random_prompts([48], seed=9)[0]
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]
    expected = oracle_greedy(model_dir, adapters, prompts, ["all-r16"] * 2, NEW_TOKENS, fp8_kv_attention(SCALES))
    llm = fp8_llm(fp8, page_size=8)
    first = llm.generate(prompts[:1], greedy(n=2), adapters=["all-r16"])[0]
    computed = llm.engine.num_prompt_tokens_computed
    second = llm.generate(prompts[1:], greedy(), adapters=["all-r16"])[0]
    assert llm.engine.num_prompt_tokens_computed - computed < len(prompts[1]), "the prefix's pages were reused"
    assert [s.token_ids for s in first.outputs] == [expected[0]] * 2
    assert second.outputs[0].token_ids == expected[1]
    llm.engine.check()


def test_calibrated_scales_are_powers_of_two_over_the_largest_k_and_v(fp8):
    """The engine's calibration against the largest |K| and |V| per layer and head that transformers computes
    over the same prompts (keys after rotary, as the cache holds them)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    model_dir = fp8[0]
    amax = torch.zeros(LAYERS, 2, KV_HEADS)

    def recording(module, query, key, value, attention_mask, **kwargs):
        for which, x in enumerate((key, value)):                        # x [batch, kv_heads, seq, head_dim]
            amax[module.layer_idx, which] = torch.maximum(amax[module.layer_idx, which], x.abs().amax(dim=(0, 2, 3)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("record_kv_amax", recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register("record_kv_amax", sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.set_attn_implementation("record_kv_amax")
    with torch.inference_mode():
        for prompt in calibration_prompts(AutoTokenizer.from_pretrained(str(model_dir)), 512):
            model(input_ids=torch.from_numpy(prompt)[None])
    llm = LLM(str(model_dir), kv_cache_dtype="fp8")
    scales = llm.engine.runner.memory.kv_scales.cpu()
    assert torch.equal(scales, torch.exp2(torch.ceil(torch.log2(scales))))        # powers of two
    assert bool((amax / scales <= 448).all()) and bool((amax / scales > 224).all())


def test_scales_from_a_checkpoint(fp8, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(fp8[0], model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    for layer in range(LAYERS):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = SCALES[layer, 0]            # one per KV head
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.125 * (layer + 1))   # per tensor
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", kv_cache_scales="checkpoint")
    scales = llm.engine.runner.memory.kv_scales.cpu()
    assert torch.equal(scales[:, 0], SCALES[:, 0])
    assert scales[:, 1].tolist() == [[0.125, 0.125], [0.25, 0.25]]
    with pytest.raises(ValueError, match="has no layer 0 k_scale"):
        LLM(str(fp8[0]), kv_cache_dtype="fp8", kv_cache_scales="checkpoint")


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "JSONDecodeError"),
    ('{"k_scale": [1.0, 1.0]}', "v_scale"),
    ('{"k_scale": [1.0], "v_scale": [1.0]}', "IndexError"),
    ('{"k_scale": [[1, 2, 3], 1], "v_scale": [1, 1]}', "3 scales for 2 KV heads"),
    ('{"k_scale": [0, 1], "v_scale": [1, 1]}', "finite and positive"),
])
def test_a_bad_scales_file_is_refused_naming_the_problem(fp8, tmp_path, content, message):
    path = tmp_path / "scales.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        LLM(str(fp8[0]), kv_cache_dtype="fp8", kv_cache_scales=str(path))


@pytest.mark.parametrize(("options", "message"), [
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype_skip_layers": "0"}, "set kv_cache_dtype fp8"),
    ({"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": "first"}, "layer indices"),
    ({"kv_cache_dtype": "fp8", "kv_cache_scales": "guess"}, "kv_cache_scales must be one of"),
])
def test_bad_kv_cache_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_a_skip_layer_the_model_lacks_is_refused(fp8):
    with pytest.raises(ValueError, match=r"skip layers \[5\] are not layers"):
        LLM(str(fp8[0]), kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="0,5")


def test_the_same_bytes_hold_twice_the_tokens(fp8):
    """bfloat16 weights, as on a GPU: the FP8 cache's page has half the bytes, so the same pool_gib holds twice
    the pages, and the tokens they can hold."""
    sixteen = LLM(str(fp8[0]), dtype="bfloat16", pool_gib=0.02).pool_stats()
    eight = LLM(str(fp8[0]), dtype="bfloat16", pool_gib=0.02, kv_cache_dtype="fp8", kv_cache_scales="ones").pool_stats()
    assert eight["total_pages"] == 2 * sixteen["total_pages"]
    assert eight["kv_token_capacity"] == 2 * sixteen["kv_token_capacity"] == 2 * 16 * sixteen["total_pages"]


def test_the_simulator_admits_twice_the_sequences_in_the_same_bytes():
    """A Llama-3-8B-shaped pool of 1 GiB in pages of a 16-bit and of an FP8 cache, each run by the scheduler in
    the simulator: where pages bound the batch, the FP8 pool runs about twice the sequences at once."""
    def peak_batch(kv_dtype: torch.dtype | None) -> int:
        shape = PoolShape(32, 0, 16, 8, 128, torch.bfloat16, kv_dtype)
        num_pages = 2 ** 30 // shape.bytes_per_page
        config = EngineConfig(num_pages=num_pages, max_num_seqs=256, watermark=0.0)
        scheduler = Scheduler(config.scheduler_config(0, 4096), PageAllocator(num_pages, config.page_size))
        result = simulate(scheduler, [SimRequest(200, 56) for _ in range(200)], lambda out, s: 1.0)
        return max(result.batch_sizes)

    sixteen, eight = peak_batch(None), peak_batch(torch.float8_e4m3fn)
    assert sixteen < 64 and 1.8 <= eight / sixteen <= 2.2


def test_prefix_cache_salt_covers_the_cache_dtype(fp8):
    plain, quantized = LLM(str(fp8[0])), LLM(str(fp8[0]), kv_cache_dtype="fp8", kv_cache_scales="ones")
    secret = np.zeros(32, dtype=np.uint8).tobytes()
    plain.engine._salt_secret = quantized.engine._salt_secret = secret
    assert plain.engine.cache_salt("t") != quantized.engine.cache_salt("t")
