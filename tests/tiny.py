"""Tiny random-weight models and PEFT adapters for tests, and the transformers + PEFT oracle."""
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slora.models.tiny import build_demo_adapter, build_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets, alpha, seed, extra LoraConfig fields)
TEST_ADAPTERS = {
    "attn-r4": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, 11, {}),
    "mlp-r8": (8, ["gate_proj", "up_proj", "down_proj"], 16, 12, {}),
    "all-r16": (16, ALL, 32, 13, {}),
    "rs-pattern": (8, ALL, 16, 14, {"use_rslora": True, "rank_pattern": {"q_proj": 4, "down_proj": 12},
                                    "alpha_pattern": {"v_proj": 32}}),
}
ARCH_OVERRIDES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}}


def make_model(root: Path, architecture: str = "llama", seed: int = 0, **overrides: object) -> Path:
    folder = root / f"model-{architecture}"
    build_tiny_model(folder, seed=seed, architecture=architecture, num_hidden_layers=2,
                     **{**ARCH_OVERRIDES[architecture], **overrides})
    return folder


def make_adapters(model_dir: Path, root: Path, names: list[str] | None = None) -> dict[str, Path]:
    paths = {}
    for name in names or list(TEST_ADAPTERS):
        rank, targets, alpha, seed, extra = TEST_ADAPTERS[name]
        paths[name] = root / name
        build_demo_adapter(model_dir, paths[name], rank, targets, alpha, seed, **extra)
    return paths


def force_lora_deltas(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every step's LoRA a delta added by the op after each projection (LoraStep.deltas, as the CUDA
    decode graphs run it) instead of added after the GEMM; returns the layers of the deltas computed."""
    from slora.execution.lora_backend import LoraStep
    init, delta = LoraStep.__init__, LoraStep.delta
    layers: list[int] = []
    monkeypatch.setattr(LoraStep, "__init__",
                        lambda self, tables, kernels, backend, deltas=False, side_stream=None, tp=None:
                        init(self, tables, kernels, backend, True, side_stream, tp))
    monkeypatch.setattr(LoraStep, "delta", lambda self, *args: (layers.append(args[0]), delta(self, *args))[1])
    return layers


def record_attention(monkeypatch: pytest.MonkeyPatch, backend: type | None = None) -> list[tuple[str, int]]:
    """(which call, query rows) of each attention of `backend` (default: the reference one) from now on: "all"
    the step's rows, or "rows" some of them (attend_rows)."""
    from slora.execution.attention_backend import ReferenceAttention
    backend = backend or ReferenceAttention
    attended: list[tuple[str, int]] = []
    attend, attend_rows = backend.attend, backend.attend_rows
    monkeypatch.setattr(backend, "attend", lambda self, query, *args, **kwargs: (
        attended.append(("all", query.shape[0])), attend(self, query, *args, **kwargs))[1])
    monkeypatch.setattr(backend, "attend_rows", lambda self, query, *args: (
        attended.append(("rows", query.shape[0])), attend_rows(self, query, *args))[1])
    return attended


def random_prompts(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def fp8_kv_attention(kv_scales: torch.Tensor, skip_layers: frozenset[int] = frozenset()) -> str:
    """Register, under a name it returns, a transformers attention that sees K and V as an FP8 cache holds them:
    each layer's (rotated) keys and values divided by its heads' scales `kv_scales` `[layers, 2, kv_heads]`,
    rounded to E4M3 (clamped to +-448) and multiplied back, except in `skip_layers`; then SDPA. Written apart from
    slora's references: torch's own float8 conversion."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def as_cached(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:     # x [batch, kv_heads, seq, head_dim]
        scales = scales[None, :, None, None]
        return (x / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scales

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if layer not in skip_layers:
            key, value = as_cached(key, kv_scales[layer, 0]), as_cached(value, kv_scales[layer, 1])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"fp8_kv_{id(attention)}"
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)      # else a padded row's mask would be lost
    return name


@torch.inference_mode()
def oracle_greedy(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]], adapter_names: list[str | None],
                  max_new_tokens: int, attention: str | None = None) -> list[list[int]]:
    """Greedy tokens from transformers + PEFT, all prompts in one left-padded batch with per-row
    adapters through `adapter_names` (float32 on the CPU, no EOS stop). attention: a registered attention
    implementation to run with (fp8_kv_attention)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if attention is not None:
        model.set_attn_implementation(attention)
    names = list(adapters)
    if names:
        model = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name)
        model.eval()
    rows = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        logits = _forward_padded(model, rows, [n or "__base__" for n in adapter_names], bool(names))
        for row, token in zip(rows, logits.argmax(-1).tolist()):
            row.append(token)
    return [row[len(p):] for row, p in zip(rows, prompts)]


def oracle_beam_search(model_dir: Path, adapters: dict[str, Path], prompt: list[int], adapter: str | None, *,
                       width: int, max_new_tokens: int, stop_token_ids: list[int], n: int = 1,
                       length_penalty: float = 1.0, early_stopping: bool | str = False) -> list[list[int]]:
    """The best n beams of transformers' beam search (+ PEFT with `adapter`), float32 on the CPU: each one's
    generated tokens, through its stop token if one ended it. `stop_token_ids` must not be empty: transformers
    would take the model's EOS instead."""
    assert stop_token_ids, "transformers falls back to the model's EOS without stop tokens"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapters[adapter]), adapter_name=adapter).eval()
    pad = stop_token_ids[0] if stop_token_ids else 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=stop_token_ids or None, pad_token_id=pad)
    return [_through_first_stop(row[len(prompt):].tolist(), stop_token_ids) for row in out]


def _through_first_stop(tokens: list[int], stop_token_ids: list[int]) -> list[int]:
    """Tokens up to and including the first stop token (transformers pads a shorter beam after it)."""
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[:index + 1]
    return tokens


def _forward_padded(model, rows: list[list[int]], adapter_names: list[str], with_peft: bool) -> torch.Tensor:
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = {"adapter_names": adapter_names} if with_peft else {}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **kwargs)
    return out.logits[:, -1, :]


def edit_config(folder: Path, **changes: object) -> None:
    """Overwrite fields of a PEFT folder's adapter_config.json."""
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Let `change` edit a PEFT folder's tensors in place, then save them back."""
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def first_key(tensors: dict[str, torch.Tensor], part: str) -> str:
    """The first tensor name (sorted) that contains `part`."""
    return next(k for k in sorted(tensors) if part in k)
