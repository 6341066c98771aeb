"""Adapters uploaded by a hostile tenant (the findings of a hostile review): each is refused fast with an
AdapterError naming the field or tensor, and leaves the engine untouched."""
import re
import shutil
import threading
import time

import pytest
import torch
from peft.utils.other import get_pattern_key
from tiny import edit_config, edit_weights, first_key

from slora import LLM
from slora.adapters import config as adapter_config
from slora.adapters.config import parse_adapter_config
from slora.adapters.errors import AdapterError
from slora.adapters.packing import pack_adapter
from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import load_adapter
from slora.models.llama import LORA_LAYERS_PREFIX, LORA_MODULE_PATHS, LORA_MODULES

# Exponential backtracking against every module name: none holds three digits in a row, so the engine
# tries every way of splitting the name between the three loops before it fails.
SLOW_REGEX = r"(?:.|.)*(?:.|.)*(?:.|.)*\d\d\d"
# The old code spent 27 s on such a regex; the refusal must come within a few match timeouts.
GENEROUS_S = 10.0
MAX_RANK = 64


def _shapes(num_layers: int) -> TargetShapes:
    """A Llama-layout model of this many layers (the feature sizes do not matter to config parsing)."""
    return TargetShapes(num_layers, tuple((module, (64, 64)) for module in LORA_MODULES),
                        tuple(LORA_MODULE_PATHS[module] for module in LORA_MODULES), LORA_LAYERS_PREFIX)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama.model_dir), page_size=16, num_pages=256, max_lora_rank=MAX_RANK)


@pytest.fixture
def folder(tiny_llama, tmp_path):
    """A copy of a valid rank-4 attention adapter (alpha 8, so lora_scaling 2), to break."""
    copy = tmp_path / "adapter"
    shutil.copytree(tiny_llama.adapters["attn-r4"], copy)
    return copy


def refuse(llm, folder, message: str) -> str:
    """Load `folder`, expect an AdapterError holding `message`, check the engine is untouched."""
    before = llm.pool_stats()
    with pytest.raises(AdapterError) as refused:
        llm.load_adapter("hostile", str(folder))
    assert message in str(refused.value)
    assert llm.pool_stats() == before
    assert "hostile" not in {e.name for e in llm.engine.adapters.visible_to(None)}
    return str(refused.value)


def base_config(**changes):
    return {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **changes}


# ---- 1. ReDoS in target_modules, rank_pattern and alpha_pattern ------------------------------------------
@pytest.mark.parametrize("field", ["target_modules", "rank_pattern", "alpha_pattern"])
def test_slow_regex_is_refused_within_its_timeout(field, llm, folder):
    edit_config(folder, **{field: SLOW_REGEX if field == "target_modules" else {SLOW_REGEX: 4}})
    start = time.monotonic()
    message = refuse(llm, folder, "the regex took too long")
    assert time.monotonic() - start < GENEROUS_S
    assert message.startswith(field)


def test_slow_regex_leaves_other_threads_running():
    """The match releases the GIL (concurrent=True): a thread holding it would stop every other thread,
    the whole server, for the match's duration."""
    refusals = []

    def parse() -> None:
        try:
            parse_adapter_config(base_config(target_modules=SLOW_REGEX), _shapes(2), MAX_RANK)
        except AdapterError as exc:
            refusals.append(str(exc))

    parsing = threading.Thread(target=parse)
    ticks = 0
    parsing.start()
    while parsing.is_alive():
        ticks += 1
        time.sleep(0.001)
    parsing.join()
    assert refusals and "the regex took too long" in refusals[0]
    assert ticks >= 10     # about MATCH_TIMEOUT_S / 1 ms when the GIL is released; 0 or 1 when held


def test_regex_budget_bounds_a_config_of_many_patterns(monkeypatch):
    """Thousands of keys, each one quick: all of a config's regex work shares one time budget."""
    monkeypatch.setattr(adapter_config, "REGEX_BUDGET_S", 0.05)
    pattern = {f"layers\\.{i}\\.mlp\\.nothing_proj": 4 for i in range(20000)}
    start = time.monotonic()
    with pytest.raises(AdapterError, match=r"^rank_pattern\[.*\]: the regex took too long"):
        parse_adapter_config(base_config(rank_pattern=pattern), _shapes(2), MAX_RANK)
    assert time.monotonic() - start < GENEROUS_S


@pytest.mark.parametrize("pattern", [r"(?:a{60000}){60000}", r"(?:(?:a{1000}){1000}){1000}x",
                                     r"[\w\W]{4294967294}", r"(?:q{40}){40}_proj"])
@pytest.mark.parametrize("field", ["target_modules", "rank_pattern", "alpha_pattern"])
def test_regex_whose_compile_would_explode_is_refused_before_compiling(field, pattern):
    """Compiling expands counted repeats and cannot be interrupted: the first pattern took gigabytes and held
    the GIL for seconds. Such patterns are refused from their parse tree, before any compile."""
    raw = base_config(**{field: pattern if field == "target_modules" else {pattern: 4}})
    start = time.monotonic()
    with pytest.raises(AdapterError, match=rf"^{field}.*: the regex repeats \d+ times in a row; at most 1000"):
        parse_adapter_config(raw, _shapes(2), MAX_RANK)
    assert time.monotonic() - start < GENEROUS_S


def test_counted_repeats_of_real_patterns_are_accepted():
    raw = base_config(target_modules=r"model\.layers\.\d{1,3}\.self_attn\.(q|v)_proj",
                      rank_pattern={r"layers\.[0-9]{1}\.self_attn\.q_proj": 8})
    config = parse_adapter_config(raw, _shapes(2), MAX_RANK)
    assert config.target_modules == ("q_proj", "v_proj")
    assert config.module_rank("model.layers.1.self_attn.q_proj") == 8


@pytest.mark.parametrize("field", ["target_modules", "rank_pattern", "alpha_pattern"])
def test_overlong_regex_is_refused(field):
    long_regex = "q" * 260 + "_proj$"      # 266 characters
    raw = base_config(**{field: long_regex if field == "target_modules" else {long_regex: 4}})
    with pytest.raises(AdapterError, match=rf"^{field}.*: the regex is longer than 256 characters"):
        parse_adapter_config(raw, _shapes(2), MAX_RANK)


PATTERN_CASES = {  # PEFT features: rank_pattern, alpha_pattern and regex target_modules, with overlaps
    "suffix": dict(rank_pattern={"q_proj": 2, "down_proj": 6}, alpha_pattern={"v_proj": 32}),
    "first-key-wins": dict(rank_pattern={r"layers\.1\.self_attn\.q_proj": 3, "q_proj": 5, r".*\.1\..*": 7}),
    "dot-wildcard": dict(rank_pattern={"layers.3.mlp.up_proj": 3, "self_attn.o.proj": 2}),
    "regex-target": dict(target_modules=r".*\.[0-2]\.(self_attn\.(q|k)|mlp\.gate)_proj",
                         alpha_pattern={"gate_proj": 3, r"model\.layers\.0\..*": 4}),
    "key-breaks-out": dict(rank_pattern={"x)|(.*v_proj": 6}),
}


@pytest.mark.parametrize("case", sorted(PATTERN_CASES))
def test_resolved_tables_match_peft(case):
    """What the parse-time tables give each module is what PEFT's own matching gives."""
    raw = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "use_rslora": case == "suffix",
           **PATTERN_CASES[case]}
    shapes = _shapes(5)
    config = parse_adapter_config(raw, shapes, MAX_RANK)
    ranks, alphas = raw.get("rank_pattern", {}), raw.get("alpha_pattern", {})
    checked = 0
    for layer in range(5):
        for module in LORA_MODULES:
            name = shapes.qualified_name(layer, module)
            targeted = raw["target_modules"] == "all-linear" or bool(re.fullmatch(raw["target_modules"], name))
            assert config.targets(layer, module) == targeted
            if targeted:
                rank = ranks.get(get_pattern_key(list(ranks), name), 8)
                alpha = alphas.get(get_pattern_key(list(alphas), name), 16)
                assert config.module_rank(name) == rank
                assert config.module_scaling(name) == pytest.approx(alpha / (rank ** 0.5 if raw["use_rslora"]
                                                                             else rank))
                checked += 1
    assert checked > 0


def test_per_module_lookups_run_no_regex():
    """The loader asks for every layer x module; with a key per module (280 keys, 40 layers) a regex scan
    per question would take seconds, the parse-time tables microseconds."""
    shapes = _shapes(40)
    names = [shapes.qualified_name(layer, module) for layer in range(40) for module in LORA_MODULES]
    config = parse_adapter_config(base_config(target_modules="all-linear",
                                              rank_pattern={name: 2 for name in names}), shapes, MAX_RANK)
    start = time.monotonic()
    for _ in range(100):
        for name in names:
            assert config.module_rank(name) == 2
            config.module_scaling(name)
    assert time.monotonic() - start < 2.0    # 56,000 questions; a scan of the keys for each takes > 15 s


# ---- 2. an invalid regex as a pattern key -----------------------------------------------------------------
@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
@pytest.mark.parametrize("key", ["(", "q_proj**", "[z-a]"])
def test_invalid_pattern_key_is_refused(field, key, llm, folder):
    edit_config(folder, **{field: {key: 4}})
    message = refuse(llm, folder, "invalid regular expression")
    assert message.startswith(f"{field}[{key!r}]")


# ---- 3. a config nested deeply, or large ------------------------------------------------------------------
def test_deeply_nested_config_is_refused(llm, folder):
    (folder / "adapter_config.json").write_text('{"r": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refuse(llm, folder, "adapter_config.json is not valid JSON: nested too deeply")


def test_large_config_is_refused(llm, folder):
    path = folder / "adapter_config.json"
    path.write_text(path.read_text() + " " * (1 << 20))
    refuse(llm, folder, "adapter_config.json is larger than 1048576 bytes")


def test_long_integer_is_refused(llm, folder):
    (folder / "adapter_config.json").write_text('{"r": ' + "9" * 5000 + "}")
    refuse(llm, folder, "adapter_config.json is not valid JSON")


def test_messages_stay_short_for_huge_values(llm, folder):
    edit_config(folder, target_modules=["q_proj", "x" * 500_000])
    assert len(refuse(llm, folder, "target_modules: the base model has no LoRA-targetable module")) < 500


# ---- 4. weights in dtypes other than float16/bfloat16/float32/float64 -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_unsupported_weight_dtype_is_refused(dtype, llm, folder):
    def convert_first_a(tensors):
        key = first_key(tensors, "lora_A")
        tensors[key] = tensors[key].to(dtype)
    edit_weights(folder, convert_first_a)
    refuse(llm, folder, f"lora_A.weight': dtype {dtype} is not supported")


def test_duplicate_weight_is_refused(llm, folder):
    def duplicate(tensors):
        key = first_key(tensors, "lora_A")
        tensors[key.replace(".weight", ".default.weight")] = tensors[key].clone()
    edit_weights(folder, duplicate)
    refuse(llm, folder, "the same weight as tensor")


def test_layer_index_of_thousands_of_digits_is_refused(llm, folder):
    """int() raises ValueError, not AdapterError, on a number of more than 4300 digits."""
    def rename_first_a(tensors):
        key = first_key(tensors, "lora_A")
        tensors[key.replace(".layers.0.", f".layers.{'9' * 5000}.")] = tensors.pop(key)
    edit_weights(folder, rename_first_a)
    refuse(llm, folder, "not a LoRA A/B weight of a projection of the base model")


# ---- 5. weights or scalings that overflow once packed -----------------------------------------------------
def test_float64_weights_that_overflow_the_pool_are_refused(llm, folder):
    def huge_float64(tensors):
        key = first_key(tensors, "lora_B")
        tensors[key] = tensors[key].double().fill_(1e300)
    edit_weights(folder, huge_float64)
    message = refuse(llm, folder, "tensor 'model.layers.0.self_attn.k_proj.lora_B': in float32")
    assert "largest magnitude is inf" in message


@pytest.mark.parametrize("field", ["lora_alpha", "alpha_pattern"])
@pytest.mark.parametrize("alpha", [1e38, 10 ** 400], ids=["1e38", "10**400"])
def test_huge_alpha_is_refused(field, alpha, llm, folder):
    edit_config(folder, **{field: alpha if field == "lora_alpha" else {"q_proj": alpha}})
    refuse(llm, folder, "is above the largest supported alpha, 10000")


def test_weights_above_the_bound_are_refused(llm, folder):
    edit_weights(folder, lambda t: t[first_key(t, "lora_A")].fill_(2e4))
    refuse(llm, folder, "tensor 'model.layers.0.self_attn.k_proj.lora_A': in float32, its largest magnitude "
                        "is 20000, above 10000")


def test_b_times_its_scaling_above_the_bound_is_refused(llm, folder):
    """B of 6000 is within the bound alone; the kernels multiply it by lora_scaling 2 (alpha 8 / r 4)."""
    edit_weights(folder, lambda t: t[first_key(t, "lora_B")].fill_(6000.0))
    refuse(llm, folder, "lora_B': in float32 and times its lora_scaling 2, its largest magnitude is 12000")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_that_overflow_a_half_precision_pool_are_refused(dtype, llm, folder):
    """1e5 is finite in float32 and was accepted; in a float16 pool it is inf, in bfloat16 it rounds to a
    finite 99840, still above the bound."""
    edit_weights(folder, lambda t: t[first_key(t, "lora_A")].fill_(1e5))
    loaded = load_adapter(folder, llm.engine.shapes, MAX_RANK)
    expected = "its largest magnitude is inf" if dtype == torch.float16 else "its largest magnitude is 99840"
    with pytest.raises(AdapterError, match=rf"in {str(dtype)[6:]}, {expected}"):
        pack_adapter(loaded, llm.engine.shapes, llm.engine.runner.shape.page_elems, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_test_adapters_pack_in_every_pool_dtype(dtype, llm, tiny_llama):
    """PEFT's random init (init_lora_weights=False) and real adapters sit far inside the bounds."""
    for name, path in tiny_llama.adapters.items():
        loaded = load_adapter(path, llm.engine.shapes, MAX_RANK)
        packed = pack_adapter(loaded, llm.engine.shapes, llm.engine.runner.shape.page_elems, dtype)
        assert packed.pages.dtype == dtype and bool(torch.isfinite(packed.pages).all()), name
