"""Loading a PEFT adapter folder from safetensors, with validation against the base model (DESIGN §5)."""
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from slora.adapters.config import AdapterConfig, load_adapter_config
from slora.adapters.errors import AdapterError
from slora.adapters.shapes import TargetShapes

WEIGHTS_FILE = "adapter_model.safetensors"
# What the loader and the packing to the pool dtype handle; float8 and integer weights are refused.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Layer indices of more digits belong to no model, and int() refuses numbers of thousands of digits.
MAX_LAYER_DIGITS = 9


@dataclass(frozen=True)
class LoraWeights:
    """One targeted projection of one layer: A `[rank, in_features]` and B `[out_features, rank]`."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoadedAdapter:
    """A validated adapter in host memory. `version` is the content hash of its config and weights."""

    config: AdapterConfig
    weights: dict[tuple[int, str], LoraWeights]   # (layer, module) -> weights
    version: str

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.weights.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self.config.target_modules


def load_adapter(path: str | Path, shapes: TargetShapes, max_lora_rank: int) -> LoadedAdapter:
    """Read, validate and hash the PEFT adapter in folder `path`. Raises AdapterError."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter path is not a folder: {folder.name}")
    config = load_adapter_config(folder, shapes, max_lora_rank)
    tensors = _read_safetensors(folder)
    weights = _validate_weights(config, tensors, shapes)
    return LoadedAdapter(config=config, weights=weights, version=content_hash(config, tensors))


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise AdapterError(f"adapter weights must be in {WEIGHTS_FILE}; pickle files are never loaded "
                               f"(found {', '.join(pickled)})")
        raise AdapterError(f"adapter folder has no {WEIGHTS_FILE}")
    try:
        return load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} could not be read: {exc}") from None


@functools.lru_cache(maxsize=16)
def _tensor_name_pattern(shapes: TargetShapes) -> re.Pattern[str]:
    """PEFT's names for the LoRA weights of the model's projections, `[base_model.model.]{qualified name}
    .lora_{A|B}[.{adapter name}].weight`. The layers' prefix may lack its leading parts: PEFT wrapping the
    model's body rather than the whole model names Llama's layers `layers.{i}`, not `model.layers.{i}`."""
    parts = shapes.layers_prefix.split(".")
    prefixes = "|".join(re.escape(".".join(parts[i:])) for i in range(len(parts)))
    paths = "|".join(re.escape(path) for path in shapes.module_paths)
    return re.compile(rf"(?:base_model\.model\.)?(?:{prefixes})\.([0-9]{{1,{MAX_LAYER_DIGITS}}})\.({paths})"
                      rf"\.lora_([AB])(?:\.[\w-]+)?\.weight")


def _parse_tensor_name(name: str, shapes: TargetShapes) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a LoRA weight's name."""
    match = _tensor_name_pattern(shapes).fullmatch(name)
    if match is None:
        raise AdapterError(f"tensor {name!r}: not a LoRA A/B weight of a projection of the base model, "
                           f"{shapes.layers_prefix}.<layer>.<module>.lora_A/lora_B.weight with <module> one of "
                           f"{', '.join(shapes.module_paths)} (DoRA magnitudes, biases, embeddings and lm_head "
                           "are not supported)")
    layer, path, which = match.groups()
    return int(layer), shapes.modules[shapes.module_paths.index(path)], which


def _validate_weights(config: AdapterConfig, tensors: dict[str, torch.Tensor],
                      shapes: TargetShapes) -> dict[tuple[int, str], LoraWeights]:
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        layer, module, which = _parse_tensor_name(name, shapes)
        if layer >= shapes.num_layers:
            raise AdapterError(f"tensor {name!r}: the base model has no layer {layer} (it has {shapes.num_layers})")
        if not config.targets(layer, module):
            raise AdapterError(f"tensor {name!r}: module not listed in target_modules/layers_to_transform")
        _check_dtype(name, tensor)
        pair = pairs.setdefault((layer, module), {})
        if which in pair:
            raise AdapterError(f"tensor {name!r}: the same weight as tensor {pair[which][0]!r}")
        pair[which] = (name, tensor)
    _check_all_targets_present(config, pairs, shapes)
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE}: the adapter has no LoRA weights for this model's layers")
    weights = {key: _check_pair(config, key, pair, shapes) for key, pair in sorted(pairs.items())}
    _check_finite(tensors)
    return weights


def _check_all_targets_present(config: AdapterConfig, pairs: dict, shapes: TargetShapes) -> None:
    for layer in range(shapes.num_layers):
        for module in shapes.modules:
            if config.targets(layer, module) and len(pairs.get((layer, module), {})) != 2:
                raise AdapterError(f"{WEIGHTS_FILE}: missing lora_A or lora_B for "
                                   f"{shapes.qualified_name(layer, module)}")


def _check_pair(config: AdapterConfig, key: tuple[int, str], pair: dict[str, tuple[str, torch.Tensor]],
                shapes: TargetShapes) -> LoraWeights:
    layer, module = key
    qualified = shapes.qualified_name(layer, module)
    rank = config.module_rank(qualified)
    in_features, out_features = shapes.features(module)
    (a_name, lora_a), (b_name, lora_b) = pair["A"], pair["B"]
    _check_tensor(a_name, lora_a, (rank, in_features))
    _check_tensor(b_name, lora_b, (out_features, rank))
    return LoraWeights(lora_a=lora_a, lora_b=lora_b, scaling=config.module_scaling(qualified))


def _check_tensor(name: str, tensor: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(tensor.shape) != expected:
        raise AdapterError(f"tensor {name!r}: shape {tuple(tensor.shape)} does not match the base model "
                           f"and rank, expected {expected}")


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in WEIGHT_DTYPES:
        raise AdapterError(f"tensor {name!r}: dtype {tensor.dtype} is not supported (supported: "
                           f"{', '.join(str(d).removeprefix('torch.') for d in WEIGHT_DTYPES)})")


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Every weight finite: one fused max-magnitude over all tensors (a tenth of the time of checking each
    of an 8B adapter's hundreds of tensors), NaN or inf making a maximum non-finite. A maximum, unlike a
    sum of squares, cannot overflow, so a finite maximum proves the tensor finite."""
    if not tensors:
        return
    maxima = torch.stack(torch._foreach_norm(list(tensors.values()), ord=math.inf, dtype=torch.float64))
    bad = torch.nonzero(~torch.isfinite(maxima))
    if len(bad):
        raise AdapterError(f"tensor {list(tensors)[int(bad[0])]!r}: holds non-finite values (NaN or inf)")


def content_hash(config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the canonical config and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    digest.update(json.dumps(config.canonical(), sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        header = f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode()
        digest.update(header)
        # Hashed in place, no copy. numpy's stubs give ndarray its buffer protocol (__buffer__) only on 3.12+.
        digest.update(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")  # type: ignore[arg-type]
    return digest.hexdigest()
