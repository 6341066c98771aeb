"""Building a model from a Hugging Face folder: config.json + model.safetensors (or sharded)."""
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from slora.models.config import ModelConfig, UnsupportedModelError, load_model_config
from slora.models.registry import ServedModel, build_model
from slora.models.rope import RotaryEmbedding
from slora.models.sharding import Shard, shard_state

# An FP8 checkpoint's KV scales (vLLM's names): read by slora.kv_scales, not weights of the model.
KV_SCALE_NAME = re.compile(r"model\.layers\.(?P<layer>\d+)\.self_attn\.(?P<which>[kv])_scale")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise UnsupportedModelError(f"model folder {folder} has no model.safetensors or "
                                "model.safetensors.index.json (pickled weights are never loaded)")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        state.update(load_file(str(file)))
    return state


# vLLM's dummy loader draws every parameter, norms included, uniform in [-DUMMY_RANGE, DUMMY_RANGE].
DUMMY_RANGE = 1e-3


def _seeded_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int,
                  init: Callable[[str, torch.Tensor], None], shard: Shard | None = None) -> ServedModel:
    """A model on `device` whose parameters `init(name, param)` fills, after seeding torch's generator. A
    shard is cut from the whole model drawn on the CPU, so that every rank holds part of the same weights."""
    torch.manual_seed(seed)
    model = build_model(config, device if shard is None else "cpu")
    assert isinstance(model, nn.Module), "every model class is a torch module"
    model = model.to(dtype)
    for name, param in model.named_parameters():
        init(name, param.data)
    if shard is not None:
        return _assembled(config, model.state_dict(), device, shard)
    model.fuse_projections()
    return model.eval()


def _normal_weights(name: str, param: torch.Tensor) -> None:
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        param.fill_(1.0)
    else:
        param.normal_(0.0, 0.02)


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 shard: Shard | None = None) -> ServedModel:
    """A model with seeded random weights made on `device` (tests and kernel benchmarks of real-sized shapes,
    no checkpoint): norms of one, the rest normal with std 0.02, so that logits differ enough for greedy
    decoding to be stable."""
    return _seeded_model(config, dtype, device, seed, _normal_weights, shard)


def dummy_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                shard: Shard | None = None) -> ServedModel:
    """load_format="dummy": random weights drawn as vLLM's dummy loader draws them, so that a benchmark
    against its figures computes on data of the same distribution (a GEMM's power draw, and so its clock
    under the GPU's power limit, depends on its operands)."""
    return _seeded_model(config, dtype, device, seed, _uniform_weights, shard)


def _uniform_weights(_: str, param: torch.Tensor) -> None:
    param.uniform_(-DUMMY_RANGE, DUMMY_RANGE)


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device,
               load_format: str = "safetensors", shard: Shard | None = None) -> ServedModel:
    """Our own model, with the checkpoint's weights (or random ones with load_format="dummy"), in `dtype`
    on `device`; with `shard`, that tensor-parallel rank's part of it (slora.models.sharding)."""
    folder = Path(folder)
    config = load_model_config(folder)
    if load_format == "dummy":
        return dummy_model(config, dtype, device, shard=shard)
    state = {name: t for name, t in read_state_dict(folder).items() if not KV_SCALE_NAME.fullmatch(name)}
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {name: tensor.to(dtype) for name, tensor in state.items()}
    whole = build_model(config, "meta")
    assert isinstance(whole, nn.Module), "every model class is a torch module"
    _check_state_names(whole, state)
    return _assembled(config, state, device, shard or Shard(0, 1))


def _assembled(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, shard: Shard) -> ServedModel:
    """The model of `shard`'s part of `config`, its weights cut from the whole model's `state`, on `device`."""
    model = build_model(config.sharded(shard.size), "meta")
    assert isinstance(model, nn.Module), "every model class is a torch module"
    model.load_state_dict(shard_state(state, shard), strict=False, assign=True)
    model.rotary = RotaryEmbedding(config.rope, config.head_dim)   # rebuilt off the meta device
    model = model.to(device)
    model.fuse_projections()
    return model.eval()


def _check_state_names(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
    unexpected = sorted(n for n in set(state) - expected if "rotary_emb" not in n)
    if unexpected:
        raise UnsupportedModelError(f"checkpoint has weights this architecture does not use: "
                                    f"{', '.join(unexpected[:5])}")
    for name, param in model.state_dict().items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise UnsupportedModelError(f"weight {name}: shape {tuple(state[name].shape)} does not match "
                                        f"config.json, expected {tuple(param.shape)}")
