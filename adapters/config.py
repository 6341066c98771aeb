"""Parsing and validation of a PEFT `adapter_config.json` (DESIGN §5)."""
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slora.adapters.errors import AdapterError
from slora.kernels.layout import LORA_MODULES

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of a PEFT LoRA config that change what the adapter computes."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]            # subset of LORA_MODULES, in that order
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    target_regex: str | None = None            # set when target_modules was given as a regex

    def targets(self, layer: int, module: str) -> bool:
        """Whether the adapter has weights for `module` in decoder layer `layer`."""
        if module not in self.target_modules or not self.targets_layer(layer):
            return False
        return self.target_regex is None or bool(re.fullmatch(self.target_regex,
                                                               qualified_module_name(layer, module)))

    def module_rank(self, qualified_name: str) -> int:
        """Rank of the module `model.layers.{i}.{self_attn|mlp}.{name}`, honouring rank_pattern."""
        key = _pattern_key(self.rank_pattern, qualified_name)
        return self.r if key is None else self.rank_pattern[key]

    def module_scaling(self, qualified_name: str) -> float:
        """lora_alpha / r (or / sqrt(r) with rsLoRA) for one module, honouring both patterns."""
        key = _pattern_key(self.alpha_pattern, qualified_name)
        alpha = self.lora_alpha if key is None else self.alpha_pattern[key]
        rank = self.module_rank(qualified_name)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets_layer(self, layer: int) -> bool:
        return self.layers_to_transform is None or layer in self.layers_to_transform

    def canonical(self) -> dict[str, Any]:
        """A JSON-able form with sorted keys, used in the adapter's content hash."""
        return {"r": self.r, "lora_alpha": self.lora_alpha, "target_modules": list(self.target_modules),
                "use_rslora": self.use_rslora, "rank_pattern": dict(sorted(self.rank_pattern.items())),
                "alpha_pattern": dict(sorted(self.alpha_pattern.items())),
                "layers_to_transform": None if self.layers_to_transform is None
                else list(self.layers_to_transform), "target_regex": self.target_regex}


def _pattern_key(pattern: dict[str, Any], qualified_name: str) -> str | None:
    """The first pattern key that matches the end of the module name, as PEFT matches them."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", qualified_name):
            return key
    return None


def qualified_module_name(layer: int, module: str) -> str:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def load_adapter_config(path: Path, num_layers: int, max_lora_rank: int) -> AdapterConfig:
    """Read and validate `adapter_config.json` in the folder `path`."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"adapter folder has no adapter_config.json: {path.name}")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError("adapter_config.json must hold a JSON object")
    return parse_adapter_config(raw, num_layers, max_lora_rank)


def parse_adapter_config(raw: dict[str, Any], num_layers: int, max_lora_rank: int) -> AdapterConfig:
    """Validate a PEFT LoRA config dict; every refusal names the offending field."""
    _check_unsupported_features(raw)
    target_modules = raw.get("target_modules")
    is_regex = isinstance(target_modules, str) and target_modules != ALL_LINEAR
    return AdapterConfig(
        r=_check_rank("r", raw.get("r"), max_lora_rank),
        lora_alpha=_check_alpha("lora_alpha", raw.get("lora_alpha", raw.get("r"))),
        target_modules=_parse_target_modules(raw.get("target_modules"), num_layers),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern={k: _check_rank(f"rank_pattern[{k!r}]", v, max_lora_rank)
                      for k, v in _dict_field(raw, "rank_pattern").items()},
        alpha_pattern={k: _check_alpha(f"alpha_pattern[{k!r}]", v)
                       for k, v in _dict_field(raw, "alpha_pattern").items()},
        layers_to_transform=_parse_layers(raw.get("layers_to_transform"), num_layers),
        target_regex=target_modules if is_regex else None,
    )


def _check_unsupported_features(raw: dict[str, Any]) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type: only LORA adapters are supported, got {peft_type!r}")
    if raw.get("use_dora"):
        raise AdapterError("use_dora: DoRA adapters are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError("modules_to_save: adapters that replace whole modules are not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias: only 'none' is supported, got {raw.get('bias')!r}")
    if raw.get("lora_bias"):
        raise AdapterError("lora_bias: LoRA bias terms are not supported")
    if raw.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out: transposed (Conv1D-style) weights are not supported")


def _check_rank(name: str, value: Any, max_lora_rank: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{name}: the LoRA rank must be a positive integer, got {value!r}")
    if value > max_lora_rank:
        raise AdapterError(f"{name}: rank {value} is above max_lora_rank={max_lora_rank}")
    return value


def _check_alpha(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AdapterError(f"{name}: must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise AdapterError(f"{name}: must be finite and positive, got {value!r}")
    return float(value)


def _dict_field(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterError(f"{name}: must be an object mapping module names to values")
    return value


def _parse_target_modules(value: Any, num_layers: int) -> tuple[str, ...]:
    if value is None or value == []:
        raise AdapterError("target_modules: the adapter targets no module")
    if value == ALL_LINEAR:
        return LORA_MODULES
    if isinstance(value, str):
        return _modules_matching_regex(value, num_layers)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"target_modules: must be a list of module names or a regex, got {value!r}")
    for entry in value:
        if entry.rsplit(".", 1)[-1] not in LORA_MODULES:
            raise AdapterError(f"target_modules: the base model has no LoRA-targetable module {entry!r} "
                               f"(supported: {', '.join(LORA_MODULES)})")
    named = {entry.rsplit(".", 1)[-1] for entry in value}
    return tuple(m for m in LORA_MODULES if m in named)


def _modules_matching_regex(pattern: str, num_layers: int) -> tuple[str, ...]:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise AdapterError(f"target_modules: invalid regular expression {pattern!r}: {exc}") from None
    matched = tuple(m for m in LORA_MODULES
                    if any(regex.fullmatch(qualified_module_name(i, m)) for i in range(num_layers)))
    if not matched:
        raise AdapterError(f"target_modules: the regex {pattern!r} matches no module of the base model")
    return matched


def _parse_layers(value: Any, num_layers: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise AdapterError(f"layers_to_transform: must be an int or a list of ints, got {value!r}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise AdapterError(f"layers_to_transform: layers {bad} do not exist (the model has {num_layers})")
    return tuple(sorted(set(layers)))
