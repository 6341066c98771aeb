"""Every refusal of DESIGN §5's validation table names its field, and leaves the engine untouched."""
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny import edit_config, edit_weights, first_key, random_prompts

from slora import LLM, SamplingParams
from slora.adapters.errors import AdapterError


def set_first_a_nan(tensors):
    tensors[first_key(tensors, "lora_A")][0, 0] = math.nan


def set_last_b_inf(tensors):
    key = sorted(k for k in tensors if "lora_B" in k)[-1]
    tensors[key][-1, -1] = math.inf


def widen_first_a(tensors):
    key = first_key(tensors, "lora_A")
    tensors[key] = torch.randn(tensors[key].shape[0], tensors[key].shape[1] + 1)


def add_magnitude(tensors):
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(128)


def add_bias(tensors):
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.ones(128)


def pickle_only(folder):
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")


CASES = {  # case -> (how to break a valid rank-4 attention adapter, words the message must hold)
    "rank-zero": (lambda f: edit_config(f, r=0), "r: the LoRA rank must be a positive integer"),
    "rank-above-max": (lambda f: edit_config(f, r=128), "above max_lora_rank"),
    "alpha-nan": (lambda f: edit_config(f, lora_alpha=float("nan")), "lora_alpha"),
    "alpha-negative": (lambda f: edit_config(f, lora_alpha=-2), "lora_alpha: must be finite and positive"),
    "dora": (lambda f: edit_config(f, use_dora=True), "use_dora"),
    "modules-to-save": (lambda f: edit_config(f, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (lambda f: edit_config(f, bias="all"), "bias: only 'none'"),
    "unknown-target": (lambda f: edit_config(f, target_modules=["q_proj", "lm_head"]), "target_modules"),
    "layers-out-of-range": (lambda f: edit_config(f, layers_to_transform=[7]), "layers_to_transform"),
    "rank-pattern-zero": (lambda f: edit_config(f, rank_pattern={"q_proj": 0}), "rank_pattern"),
    "not-lora": (lambda f: edit_config(f, peft_type="IA3"), "peft_type"),
    "shape-mismatch": (lambda f: edit_weights(f, widen_first_a), "does not match the base model"),
    "non-finite": (lambda f: edit_weights(f, set_first_a_nan), "non-finite"),
    "non-finite-inf": (lambda f: edit_weights(f, set_last_b_inf), "lora_B.weight': holds non-finite"),
    "dora-tensor": (lambda f: edit_weights(f, add_magnitude), "lora_magnitude_vector"),
    "bias-tensor": (lambda f: edit_weights(f, add_bias), "lora_B.bias"),
    "pickle": (pickle_only, "pickle files are never loaded"),
    "no-config": (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no-weights": (lambda f: (edit_config(f, layers_to_transform=[]), edit_weights(f, lambda t: t.clear())),
                   "no LoRA weights"),
    "bad-json": (lambda f: (f / "adapter_config.json").write_text("{r: 4"), "not valid JSON"),
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama.model_dir), page_size=16, num_pages=256, max_lora_rank=64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_adapter_is_refused_with_its_field(case, llm, tiny_llama, tmp_path):
    folder = tmp_path / case
    shutil.copytree(tiny_llama.adapters["attn-r4"], folder)
    breaker, message = CASES[case]
    breaker(folder)
    before = llm.pool_stats()
    with pytest.raises(AdapterError, match=message.replace("(", r"\(")):
        llm.load_adapter(case, str(folder))
    assert llm.pool_stats() == before
    assert case not in {e.name for e in llm.engine.adapters.visible_to(None)}


def to_float16_with_large_first_a(tensors):
    for key in tensors:
        tensors[key] = tensors[key].half()
    tensors[first_key(tensors, "lora_A")].fill_(5000.0)


def test_large_finite_weights_are_accepted(llm, tiny_llama, tmp_path):
    """Finiteness is checked on one fused reduction over all tensors; float16 weights of 5000 (within
    MAX_PACKED_MAGNITUDE) whose sum of squares overflows float16 must not be taken for non-finite ones.
    (Weights near 1e30 were accepted here before; they are now refused, see test_hostile.py.)"""
    folder = tmp_path / "large"
    shutil.copytree(tiny_llama.adapters["attn-r4"], folder)
    edit_weights(folder, to_float16_with_large_first_a)
    large = load_file(str(folder / "adapter_model.safetensors"))
    assert not torch.isfinite(torch._foreach_norm([large[first_key(large, "lora_A")]])[0])   # a 2-norm overflows
    llm.load_adapter("large", str(folder))
    assert "large" in {e.name for e in llm.engine.adapters.visible_to(None)}


def test_refused_adapter_leaves_running_requests_untouched(tiny_llama, tmp_path):
    prompts = random_prompts([30, 12], seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = LLM(str(tiny_llama.model_dir), num_pages=256)
    reference.load_adapter("a", str(tiny_llama.adapters["mlp-r8"]))
    expected = [o.token_ids for o in reference.generate(prompts, params, adapters=["a", None])]

    llm = LLM(str(tiny_llama.model_dir), num_pages=256)
    llm.load_adapter("a", str(tiny_llama.adapters["mlp-r8"]))
    engine = llm.engine
    engine.add_request("x", prompts[0], params, "a")
    engine.add_request("y", prompts[1], params)
    for _ in range(3):
        engine.step()
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama.adapters["all-r16"], broken)
    edit_weights(broken, set_first_a_nan)
    stats = llm.pool_stats()
    with pytest.raises(AdapterError):
        llm.load_adapter("broken", str(broken))
    assert llm.pool_stats() == stats
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done["x"], done["y"]] == expected
    engine.check()


def test_adapter_version_is_a_content_hash(llm, tiny_llama, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama.adapters["attn-r4"], copy)
    first = llm.load_adapter("one", str(tiny_llama.adapters["attn-r4"]))
    assert llm.load_adapter("two", str(copy)) == first          # same content, same version
    edit_config(copy, lora_alpha=99)
    assert llm.load_adapter("three", str(copy)) != first
