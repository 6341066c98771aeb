"""A Llama-3-8B-shaped model and rank-r adapters with random weights, made without any download."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from slora.adapters.shapes import TargetShapes
from slora.kernels.layout import LORA_MODULES
from slora.models.config import parse_model_config

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "tie_word_embeddings": False, "hidden_act": "silu",
}
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2          # layers * (K, V) * kv_heads * head_dim * bf16


def write_config(folder: Path, raw: dict = LLAMA3_8B) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def target_shapes(raw: dict = LLAMA3_8B) -> TargetShapes:
    cfg = parse_model_config(raw)
    return TargetShapes(cfg.num_layers, cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size)


def weight_bytes(raw: dict = LLAMA3_8B) -> int:
    """bf16 bytes of every weight (layers, input embedding, lm_head): 16.06 GB for Llama-3-8B."""
    cfg = parse_model_config(raw)
    layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * (cfg.num_layers * layer + 2 * cfg.vocab_size * cfg.hidden_size)


def decode_weight_bytes(batch: int, raw: dict = LLAMA3_8B) -> int:
    """Weight bytes a decode step reads: every weight but the input embedding table, of which only the
    batch's rows (15.01 GB + batch rows for Llama-3-8B, ../shared/ENVIRONMENT.md's 15.0 GB)."""
    cfg = parse_model_config(raw)
    return weight_bytes(raw) - 2 * cfg.vocab_size * cfg.hidden_size + 2 * batch * cfg.hidden_size


def adapter_bytes(rank: int, raw: dict = LLAMA3_8B) -> int:
    shapes = target_shapes(raw)
    return 2 * shapes.num_layers * sum(rank * sum(shapes.features(m)) for m in LORA_MODULES)


def write_peft_adapter(folder: Path, rank: int, seed: int, raw: dict = LLAMA3_8B) -> Path:
    """A PEFT folder with random A and B for all seven projections of every layer."""
    shapes = target_shapes(raw)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in LORA_MODULES:
            block = "self_attn" if module in LORA_MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_f, out_f = shapes.features(module)
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=generator) * 0.01).half()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=generator) * 0.01).half()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_MODULES),
              "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
