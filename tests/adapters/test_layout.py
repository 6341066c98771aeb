"""The adapter parser reads the model's module layout from its TargetShapes: which names PEFT's patterns
match and which tensor names an adapter holds. No layout is built into slora.adapters."""
import json

import pytest
import torch
from safetensors.torch import save_file

from slora.adapters.errors import AdapterError
from slora.adapters.packing import pack_adapter
from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import load_adapter
from slora.models.config import parse_model_config
from slora.models.llama import LlamaForCausalLM

# A GPT-2-like layout: other paths inside a layer, another prefix for the layers.
MODULES = (("q_proj", (32, 32)), ("v_proj", (32, 16)), ("down_proj", (64, 32)))
PATHS = ("attn.q_proj", "attn.v_proj", "ffn.down_proj")
SHAPES = TargetShapes(3, MODULES, PATHS, "transformer.h")
RANK = 4


def write_adapter(folder, names: dict[str, tuple[int, int]], **config) -> None:
    """A PEFT folder holding a random tensor of each shape under each name."""
    folder.mkdir()
    raw = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": "all-linear", **config}
    (folder / "adapter_config.json").write_text(json.dumps(raw))
    save_file({name: torch.randn(shape) for name, shape in names.items()}, str(folder / "adapter_model.safetensors"))


def peft_names(prefix: str, paths=PATHS, layers=range(3)) -> dict[str, tuple[int, int]]:
    """The tensor names and shapes PEFT writes for a rank-RANK adapter on these modules of the layers."""
    names = {}
    for layer in layers:
        for (_, (in_features, out_features)), path in zip(MODULES, paths):
            names[f"{prefix}.{layer}.{path}.lora_A.weight"] = (RANK, in_features)
            names[f"{prefix}.{layer}.{path}.lora_B.weight"] = (out_features, RANK)
    return names


@pytest.mark.parametrize("prefix", ["base_model.model.transformer.h", "transformer.h", "base_model.model.h"])
def test_adapter_in_another_layout_loads(prefix, tmp_path):
    """PEFT's names for this layout, wrapped in PeftModel or not, of the whole model or of its body."""
    names = peft_names(prefix)    # rank 2 for layer 1's down_proj, which rank_pattern names in this layout
    names[f"{prefix}.1.ffn.down_proj.lora_A.weight"] = (2, 64)
    names[f"{prefix}.1.ffn.down_proj.lora_B.weight"] = (32, 2)
    write_adapter(tmp_path / "a", names, rank_pattern={r"h\.1\.ffn\.down_proj": 2})

    loaded = load_adapter(tmp_path / "a", SHAPES, max_lora_rank=16)
    assert set(loaded.weights) == {(layer, m) for layer in range(3) for m, _ in MODULES}
    assert loaded.weights[1, "down_proj"].rank == 2 and loaded.weights[0, "down_proj"].rank == RANK
    assert loaded.config.module_rank("transformer.h.1.ffn.down_proj") == 2
    pack_adapter(loaded, SHAPES, page_elems=128, dtype=torch.float32)


def test_regex_target_modules_match_the_layout_names(tmp_path):
    write_adapter(tmp_path / "a", peft_names("base_model.model.transformer.h", PATHS[:1], layers=[0, 2]),
                  target_modules=r"transformer\.h\.[02]\.attn\.q_proj")
    loaded = load_adapter(tmp_path / "a", SHAPES, max_lora_rank=16)
    assert loaded.config.target_modules == ("q_proj",)
    assert set(loaded.weights) == {(0, "q_proj"), (2, "q_proj")}
    assert loaded.config.targets(2, "q_proj") and not loaded.config.targets(1, "q_proj")


@pytest.mark.parametrize("names", [
    peft_names("base_model.model.model.layers", ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")),
    peft_names("base_model.model.transformer.h", ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")),
    peft_names("base_model.model.model.layers"),
    peft_names("base_model.model.transformer.h", ("attn.q_proj", "ffn.v_proj", "ffn.down_proj")),
], ids=["llama", "llama-paths", "llama-prefix", "wrong-block"])
def test_llama_style_names_are_refused(names, tmp_path):
    write_adapter(tmp_path / "a", names)
    with pytest.raises(AdapterError, match=r"not a LoRA A/B weight of a projection of the base model, "
                                           r"transformer\.h\.<layer>\.<module>.* attn\.q_proj, attn\.v_proj, "
                                           r"ffn\.down_proj"):
        load_adapter(tmp_path / "a", SHAPES, max_lora_rank=16)


def test_layer_beyond_the_model_is_refused(tmp_path):
    write_adapter(tmp_path / "a", peft_names("transformer.h", layers=range(4)))
    with pytest.raises(AdapterError, match=r"transformer\.h\.3\.attn\.q_proj.*no layer 3 \(it has 3\)"):
        load_adapter(tmp_path / "a", SHAPES, max_lora_rank=16)


def test_missing_weight_is_named_in_the_layout(tmp_path):
    names = peft_names("transformer.h")
    del names["transformer.h.2.ffn.down_proj.lora_B.weight"]
    write_adapter(tmp_path / "a", names)
    with pytest.raises(AdapterError, match=r"missing lora_A or lora_B for transformer\.h\.2\.ffn\.down_proj$"):
        load_adapter(tmp_path / "a", SHAPES, max_lora_rank=16)


@pytest.mark.parametrize("paths, prefix, message", [
    (PATHS[:2], "transformer.h", "2 module paths for the 3 modules"),
    (("attn.q_proj", "attn.v_proj", "ffn.up_proj"), "transformer.h", "'ffn.up_proj' is not a dotted name ending "
                                                                      "in its module's name 'down_proj'"),
    (("attn.q_proj", "attn..v_proj", "ffn.down_proj"), "transformer.h", "'attn..v_proj' is not a dotted name"),
    (PATHS, "transformer.h.", "layers prefix 'transformer.h.' is not a dotted name"),
])
def test_inconsistent_layouts_are_refused(paths, prefix, message):
    with pytest.raises(ValueError, match=message):
        TargetShapes(3, MODULES, paths, prefix)


def test_llama_declares_its_modules_names(tiny_llama):
    """Each qualified name of the Llama model's TargetShapes is one of its modules, of those shapes."""
    raw = json.loads((tiny_llama.model_dir / "config.json").read_text())
    model = LlamaForCausalLM(parse_model_config(raw))
    shapes = model.lora_targets()
    modules = dict(model.named_modules())
    for layer in range(shapes.num_layers):
        for module in shapes.modules:
            linear = modules[shapes.qualified_name(layer, module)]
            assert (linear.in_features, linear.out_features) == shapes.features(module)
