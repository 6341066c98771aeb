"""Reading a Hugging Face `config.json` of the Llama family into one validated dataclass."""
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2"}


class UnsupportedModelError(ValueError):
    """The model folder holds an architecture or feature slora does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"               # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                        f"num_key_value_heads={self.num_kv_heads}")

    def sharded(self, size: int) -> "ModelConfig":
        """The part of the model one of `size` tensor-parallel ranks holds: its share of the attention heads,
        KV heads and MLP columns (Megatron's split). Raises UnsupportedModelError if one does not divide."""
        for name, count in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                            ("intermediate_size", self.intermediate_size)):
            if count % size:
                raise UnsupportedModelError(f"tensor_parallel_size={size} does not divide {name}={count}")
        return dataclasses.replace(self, num_heads=self.num_heads // size, num_kv_heads=self.num_kv_heads // size,
                                   intermediate_size=self.intermediate_size // size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. With a sliding window, sequences stay within it, where windowed
        attention equals full attention."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def load_model_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"model folder has no config.json: {folder}")
    return parse_model_config(json.loads(config_file.read_text()))


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    architecture = _architecture(raw)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    family = SUPPORTED_ARCHITECTURES[architecture]
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={raw['hidden_act']!r} is not supported (only silu)")
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture, vocab_size=raw["vocab_size"], hidden_size=hidden,
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=_rope_config(raw),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        sliding_window=_sliding_window(raw, family),
    )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(architectures) or f"model_type={raw.get('model_type')!r}"
    raise UnsupportedModelError(f"unsupported architecture {found}; slora serves "
                                f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported "
                                    "(supported: default, linear, llama3)")
    fields = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings") if k in params}
    rope = RopeConfig(theta=theta, rope_type=rope_type, **fields)
    if not (math.isfinite(rope.theta) and rope.theta > 0 and rope.factor > 0):
        raise UnsupportedModelError("rope_theta and rope_scaling.factor must be positive")
    return rope


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _sliding_window(raw: dict[str, Any], family: str) -> int | None:
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")
