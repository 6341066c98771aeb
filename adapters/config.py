"""Parsing and validation of a PEFT `adapter_config.json` (DESIGN §5).

The config comes from a tenant, so every regex in it (a `target_modules` string, the keys of rank_pattern
and alpha_pattern) is bounded in length and runs through the `regex` package under a timeout, releasing
the GIL, and only here at parse time: what the patterns give for each module of the base model is
resolved once into tables, which the loader's per-layer, per-module questions then look up.
"""
import dataclasses
import json
import math
import re
import reprlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import regex

from slora.adapters.errors import AdapterError

if TYPE_CHECKING:     # typeshed has these modules only under their old names, which 3.11+ re-export
    import sre_constants
    import sre_parse
else:
    try:                  # Python 3.11+: the parser of `re`, whose trees show each repeat's counts
        from re import _constants as sre_constants
        from re import _parser as sre_parse
    except ImportError:   # Python 3.10
        import sre_constants
        import sre_parse
from slora.adapters.shapes import TargetShapes

ALL_LINEAR = "all-linear"
# Real configs are about a kilobyte; the bound keeps a hostile file's read and parse short.
MAX_CONFIG_BYTES = 1 << 20
# Real patterns name a module or a few (".*\.(q|v)_proj", "model.layers.3.mlp.down_proj").
MAX_PATTERN_CHARS = 256
# Compiling expands counted repeats, holding the GIL, and cannot be interrupted: "(?:a{60000}){60000}" takes
# gigabytes and the whole process. So the counts of nested repeats, multiplied, are bounded before compiling
# (module names are under a hundred characters: real patterns never count near this).
MAX_REPEAT_PRODUCT = 1000
# One match of one pattern against one module name takes microseconds; backtracking blow-ups take
# seconds to years. The bound is generous for a loaded machine and still bounded.
MATCH_TIMEOUT_S = 0.25
# All compiles and matches of one config together: a config may hold thousands of keys, each just under
# MATCH_TIMEOUT_S per module. An extreme real config, a key for each of the 560 modules of an 80-layer
# model in both rank_pattern and alpha_pattern, takes about 2 s.
REGEX_BUDGET_S = 10.0
# Real adapters use lora_alpha of a few hundred at most (commonly r or 2r). Since r >= 1, every
# lora_scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is at most its alpha, so this bounds them too.
MAX_LORA_ALPHA = 1e4


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of a PEFT LoRA config that change what the adapter computes, and what its patterns
    resolve to for the modules of the base model (filled by `parse_adapter_config`)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]            # subset of the model's lora_modules, in that order
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    target_regex: str | None = None            # set when target_modules was given as a regex
    regex_targets: frozenset[tuple[int, str]] | None = None    # (layer, module) of what target_regex matches
    rank_overrides: dict[str, int] = field(default_factory=dict)       # qualified name -> rank_pattern's rank
    alpha_overrides: dict[str, float] = field(default_factory=dict)    # qualified name -> alpha_pattern's alpha

    def targets(self, layer: int, module: str) -> bool:
        """Whether the adapter has weights for `module` in decoder layer `layer`."""
        if module not in self.target_modules or not self.targets_layer(layer):
            return False
        return self.regex_targets is None or (layer, module) in self.regex_targets

    def module_rank(self, qualified_name: str) -> int:
        """Rank of the targeted module of this name (`TargetShapes.qualified_name`), honouring rank_pattern."""
        return self.rank_overrides.get(qualified_name, self.r)

    def module_scaling(self, qualified_name: str) -> float:
        """lora_alpha / r (or / sqrt(r) with rsLoRA) for one targeted module, honouring both patterns."""
        alpha = self.alpha_overrides.get(qualified_name, self.lora_alpha)
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


def _shown(value: Any) -> str:
    """A short repr for messages: a tenant's value may be a megabyte long or nested a thousand deep."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = 80
    return short.repr(value)


@dataclass(frozen=True)
class _Matcher:
    """A tenant's regex, compiled once, matched under a timeout and the config's shared time budget."""

    field_name: str
    search: Callable[..., Any]     # a compiled pattern's `match` or `fullmatch`
    deadline: float                # time.monotonic() at which the config's budget runs out

    def matches(self, name: str) -> bool:
        timeout = min(MATCH_TIMEOUT_S, self.deadline - time.monotonic())
        if timeout <= 0:
            raise _too_long(self.field_name)
        try:
            return self.search(name, timeout=timeout, concurrent=True) is not None
        except TimeoutError:
            raise _too_long(self.field_name) from None


def _too_long(field_name: str) -> AdapterError:
    return AdapterError(f"{field_name}: the regex took too long (each match may take {MATCH_TIMEOUT_S:g} s, "
                        f"all of the config's regexes together {REGEX_BUDGET_S:g} s)")


def _compile(field_name: str, pattern: str, deadline: float) -> regex.Pattern:
    if time.monotonic() > deadline:
        raise _too_long(field_name)
    try:
        _check_repeats(field_name, sre_parse.parse(pattern))
        return regex.compile(pattern)
    except (re.error, regex.error, OverflowError, RecursionError) as exc:
        raise AdapterError(f"{field_name}: invalid regular expression: {exc}") from None


_REPEATS = tuple(getattr(sre_constants, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                 if hasattr(sre_constants, name))


def _check_repeats(field_name: str, tree: sre_parse.SubPattern, outer: int = 1) -> None:
    """Refuse counted repeats whose counts, nested, multiply past MAX_REPEAT_PRODUCT. An open bound
    (`*`, `+`, `{m,}`) counts its minimum: the compiler expands only what is counted."""
    for op, arg in tree.data:
        if op in _REPEATS:
            # typeshed types a node's argument as the union over all opcodes; a repeat's is (min, max, body).
            low, high, body = cast("tuple[int, int, sre_parse.SubPattern]", arg)
            count = max(low, 1) if high == sre_constants.MAXREPEAT else max(high, 1)
            if outer * count > MAX_REPEAT_PRODUCT:
                raise AdapterError(f"{field_name}: the regex repeats {outer * count} times in a row; at most "
                                   f"{MAX_REPEAT_PRODUCT} are allowed")
            _check_repeats(field_name, body, outer * count)
        else:
            for child in _subpatterns(arg):
                _check_repeats(field_name, child, outer)


def _subpatterns(arg: object) -> list[sre_parse.SubPattern]:
    """The nested patterns of one parsed node (groups, alternatives, lookarounds, conditionals)."""
    items = arg if isinstance(arg, (tuple, list)) else [arg]
    found = []
    for item in items:
        if isinstance(item, sre_parse.SubPattern):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found += _subpatterns(item)
    return found


def _check_length(field_name: str, pattern: str) -> str:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{field_name}: the regex is longer than {MAX_PATTERN_CHARS} characters")
    return pattern


def _key_matcher(field_name: str, key: str, deadline: float) -> _Matcher:
    """PEFT's match of a rank_pattern / alpha_pattern key: the end of the qualified module name."""
    wrapped = rf"(.*\.)?({_check_length(field_name, key)})$"
    return _Matcher(field_name, _compile(field_name, wrapped, deadline).match, deadline)


def load_adapter_config(path: Path, shapes: TargetShapes, max_lora_rank: int) -> AdapterConfig:
    """Read and validate `adapter_config.json` in the folder `path`."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"adapter folder has no adapter_config.json: {path.name}")
    raw = _parse_json(_read_bounded(config_file))
    if not isinstance(raw, dict):
        raise AdapterError("adapter_config.json must hold a JSON object")
    return parse_adapter_config(raw, shapes, max_lora_rank)


def _read_bounded(config_file: Path) -> bytes:
    with config_file.open("rb") as stream:
        data = stream.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    return data


def _parse_json(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise AdapterError("adapter_config.json is not valid JSON: nested too deeply") from None
    except ValueError as exc:     # also UnicodeDecodeError, and integers too long to convert
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from None


def parse_adapter_config(raw: dict[str, Any], shapes: TargetShapes, max_lora_rank: int) -> AdapterConfig:
    """Validate a PEFT LoRA config dict for a base model of these shapes; every refusal names the offending
    field."""
    _check_unsupported_features(raw)
    deadline = time.monotonic() + REGEX_BUDGET_S
    r = _check_rank("r", raw.get("r"), max_lora_rank)
    lora_alpha = _check_alpha("lora_alpha", raw.get("lora_alpha", raw.get("r")))
    modules, target_regex, regex_targets = _parse_target_modules(raw.get("target_modules"), shapes, deadline)
    config = AdapterConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=modules,
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern={k: _check_rank(f"rank_pattern[{_shown(k)}]", v, max_lora_rank)
                      for k, v in _dict_field(raw, "rank_pattern").items()},
        alpha_pattern={k: _check_alpha(f"alpha_pattern[{_shown(k)}]", v)
                       for k, v in _dict_field(raw, "alpha_pattern").items()},
        layers_to_transform=_parse_layers(raw.get("layers_to_transform"), shapes.num_layers),
        target_regex=target_regex,
        regex_targets=regex_targets,
    )
    return _resolve_patterns(config, shapes, deadline)


def _resolve_patterns(config: AdapterConfig, shapes: TargetShapes, deadline: float) -> AdapterConfig:
    """The config with the rank and alpha that its patterns give each targeted module."""
    names = [shapes.qualified_name(layer, module) for layer in range(shapes.num_layers)
             for module in config.target_modules if config.targets(layer, module)]
    return dataclasses.replace(
        config, rank_overrides=_pattern_values("rank_pattern", config.rank_pattern, names, deadline),
        alpha_overrides=_pattern_values("alpha_pattern", config.alpha_pattern, names, deadline))


def _pattern_values(field_name: str, pattern: dict[str, Any], names: list[str],
                   deadline: float) -> dict[str, Any]:
    """qualified name -> the value of the first key that matches it, as PEFT picks them."""
    matchers = [(_key_matcher(f"{field_name}[{_shown(key)}]", key, deadline), value)
                for key, value in pattern.items()]
    values = {}
    for name in names:
        value = next((value for matcher, value in matchers if matcher.matches(name)), None)
        if value is not None:
            values[name] = value
    return values


def _check_unsupported_features(raw: dict[str, Any]) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(f"peft_type: only LORA adapters are supported, got {_shown(peft_type)}")
    if raw.get("use_dora"):
        raise AdapterError("use_dora: DoRA adapters are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError("modules_to_save: adapters that replace whole modules are not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias: only 'none' is supported, got {_shown(raw.get('bias'))}")
    if raw.get("lora_bias"):
        raise AdapterError("lora_bias: LoRA bias terms are not supported")
    if raw.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out: transposed (Conv1D-style) weights are not supported")


def _check_rank(name: str, value: Any, max_lora_rank: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{name}: the LoRA rank must be a positive integer, got {_shown(value)}")
    if value > max_lora_rank:
        raise AdapterError(f"{name}: rank {_shown(value)} is above max_lora_rank={max_lora_rank}")
    return value


def _check_alpha(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AdapterError(f"{name}: must be a number, got {_shown(value)}")
    if not 0 < value < math.inf:          # compared, not converted: an integer may be too large for a float
        raise AdapterError(f"{name}: must be finite and positive, got {_shown(value)}")
    if value > MAX_LORA_ALPHA:
        raise AdapterError(f"{name}: {_shown(value)} is above the largest supported alpha, {MAX_LORA_ALPHA:g}")
    return float(value)


def _dict_field(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterError(f"{name}: must be an object mapping module names to values")
    return value


def _parse_target_modules(value: Any, shapes: TargetShapes, deadline: float
                          ) -> tuple[tuple[str, ...], str | None, frozenset[tuple[int, str]] | None]:
    """(the targeted modules in the model's order, the regex, the (layer, module) of the names it matches)."""
    supported = shapes.modules
    if value is None or value == []:
        raise AdapterError("target_modules: the adapter targets no module")
    if value == ALL_LINEAR:
        return supported, None, None
    if isinstance(value, str):
        matched = _modules_matching_regex(value, shapes, deadline)
        named = {module for _, module in matched}
        return tuple(m for m in supported if m in named), value, matched
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"target_modules: must be a list of module names or a regex, got {_shown(value)}")
    for entry in value:
        if entry.rsplit(".", 1)[-1] not in supported:
            raise AdapterError(f"target_modules: the base model has no LoRA-targetable module {_shown(entry)} "
                               f"(supported: {', '.join(supported)})")
    named = {entry.rsplit(".", 1)[-1] for entry in value}
    return tuple(m for m in supported if m in named), None, None


def _modules_matching_regex(pattern: str, shapes: TargetShapes, deadline: float) -> frozenset[tuple[int, str]]:
    """(layer, module) of each module whose qualified name the `target_modules` regex matches in full, as PEFT
    matches it."""
    compiled = _compile("target_modules", _check_length("target_modules", pattern), deadline)
    matcher = _Matcher("target_modules", compiled.fullmatch, deadline)
    matched = frozenset((layer, module) for layer in range(shapes.num_layers) for module in shapes.modules
                        if matcher.matches(shapes.qualified_name(layer, module)))
    if not matched:
        raise AdapterError(f"target_modules: the regex {_shown(pattern)} matches no module of the base model")
    return matched


def _parse_layers(value: Any, num_layers: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise AdapterError(f"layers_to_transform: must be an int or a list of ints, got {_shown(value)}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise AdapterError(f"layers_to_transform: layers {_shown(bad)} do not exist (the model has {num_layers})")
    return tuple(sorted(set(layers)))
