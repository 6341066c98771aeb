"""An FP8 cache's scales (DESIGN §2): per layer and KV head, K's and V's, `[layers, 2, kv_heads]` float32.

They come from a calibration pass at start (the default), from a checkpoint's `k_scale`/`v_scale` tensors,
from a JSON file, or are all 1.0. Calibrated scales are powers of two: the largest |K| or |V| a head showed
lands between 224 and 448 (E4M3's largest value), and dividing by a power of two is exact in any arithmetic,
so the CPU references and the GPU kernels store the same bytes.
"""
import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from slora.execution.causal_lm import CausalLM
from slora.execution.model_runner import ModelRunner, prompts_batch
from slora.execution.pool_memory import PoolShape
from slora.kernels.reference import FP8_MAX
from slora.models.loader import KV_SCALE_NAME, safetensors_files
from slora.models.sharding import Shard

logger = logging.getLogger(__name__)

# What the calibration pass reads: prose, code, JSON, numbers and a chat turn, in the model's chat template when
# it has one. Short, so the pass costs a start little; varied, so the keys' and values' range is seen.
CALIBRATION_PROMPTS = (
    "Summarise the causes of the French Revolution in three sentences.",
    "Write a Python function that merges two sorted lists into one sorted list, with a docstring.",
    'Return a JSON object {"name": str, "age": int, "tags": [str]} describing a fictional librarian.',
    "What is 1234 * 5678? Show the long multiplication step by step.",
    "Translate to German: The weather is lovely today, let us walk to the harbour after lunch.",
    "List five uses of a paper clip that have nothing to do with paper.",
    "Explain what a hash table is to a ten-year-old, then to a computer science student.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3; -- what does this return?",
)
RANDOM_PROMPT_TOKENS = 256         # per prompt, for a model without a tokenizer


def kv_cache_scales(source: str, folder: Path, model: CausalLM, shape: PoolShape, device: torch.device,
                    tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, shard: Shard = Shard(0, 1)) -> Tensor:
    """The scales `[layers, 2, kv_heads]` that `source` (EngineConfig.kv_cache_scales) names; under tensor
    parallelism (`shard`), those of the rank's KV heads, which `shape` and `model` hold (calibration then runs
    on every rank at once: its forward has the ranks' collectives)."""
    size = (shape.num_layers, 2, shape.num_kv_heads)
    if source == "ones":
        logger.warning("FP8 cache with every scale 1.0: keys or values beyond +-448, or far below 1, lose "
                       "precision; calibrated scales are the default")
        return torch.ones(size)
    whole = (shape.num_layers, 2, shape.num_kv_heads * shard.size)
    if source == "checkpoint":
        return shard.part(checkpoint_scales(folder, whole), 2)
    if source != "calibrate":
        return shard.part(file_scales(Path(source), whole), 2)
    prompts = calibration_prompts(tokenizer, vocab_size)
    scales = calibrate(model, shape, device, prompts)
    logger.info("FP8 cache: scales calibrated over %d tokens, from 2**%d to 2**%d", sum(map(len, prompts)),
                int(scales.log2().min()), int(scales.log2().max()))
    return scales


def calibration_prompts(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> list[np.ndarray]:
    """CALIBRATION_PROMPTS as token ids (int64), in the chat template when there is one; random ids (seeded)
    without a tokenizer."""
    if tokenizer is None:
        draws = np.random.default_rng(0).integers(0, vocab_size, (len(CALIBRATION_PROMPTS), RANDOM_PROMPT_TOKENS))
        return list(draws.astype(np.int64))
    return [np.asarray(tokenizer.encode(_as_chat(tokenizer, text), add_special_tokens=False), dtype=np.int64)
            for text in CALIBRATION_PROMPTS]


def _as_chat(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    if not tokenizer.chat_template:
        return text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    assert isinstance(rendered, str), "tokenize=False renders text"
    return rendered


@torch.inference_mode()
def calibrate(model: CausalLM, shape: PoolShape, device: torch.device, prompts: list[np.ndarray]) -> Tensor:
    """Power-of-two scales `[layers, 2, kv_heads]` from the largest |K| and |V| of each layer and KV head over a
    prefill of `prompts` into a cache of the model's dtype (the base model's: adapters are not applied)."""
    plain = PoolShape(shape.num_layers, 0, shape.page_size, shape.num_kv_heads, shape.head_dim, shape.dtype)
    batch = prompts_batch(prompts, shape.page_size)
    pages = int(batch.block_tables.max()) + 1
    runner = ModelRunner(model, plain.with_pages(pages), device)
    runner.forward(batch)
    # Slots past a prompt's end in its last page were never written: zeros, which do not raise a maximum.
    amax = torch.stack([cache.pages.abs().amax(dim=(0, 2, 4))              # [2, heads] per layer
                        for cache in runner.memory.views.kv])
    return power_of_two_scales(amax.float().cpu())


def power_of_two_scales(amax: Tensor) -> Tensor:
    """The smallest power of two s with amax / s <= FP8_MAX, per element (1.0 where nothing was seen)."""
    amax = torch.where(amax > 0, amax, FP8_MAX)
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))


def checkpoint_scales(folder: Path, size: tuple[int, int, int]) -> Tensor:
    """The checkpoint's `model.layers.{i}.self_attn.{k,v}_scale` tensors (a scalar or one per KV head)."""
    found: dict[tuple[int, int], Tensor] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():    # noqa: SIM118 (safe_open is not a mapping)
                match = KV_SCALE_NAME.fullmatch(name)
                if match:
                    found[int(match["layer"]), "kv".index(match["which"])] = tensors.get_tensor(name).float()
    layers, _, heads = size
    missing = [f"layer {layer} {'kv'[which]}_scale" for layer in range(layers) for which in (0, 1)
               if (layer, which) not in found]
    if missing:
        raise ValueError(f"kv_cache_scales=checkpoint, but {folder} has no {', '.join(missing[:4])}")
    scales = [[_per_head(found[layer, which], heads) for which in (0, 1)] for layer in range(layers)]
    return _checked(torch.tensor(scales, dtype=torch.float32), size, str(folder))


def _per_head(scale: Tensor, heads: int) -> list[float]:
    """A checkpoint's scale, a scalar (per tensor) or one per KV head, as one per head."""
    values = scale.flatten().tolist()
    return values * heads if len(values) == 1 else values


def file_scales(path: Path, size: tuple[int, int, int]) -> Tensor:
    """Scales from a JSON file `{"k_scale": [...], "v_scale": [...]}`, one entry per layer, each a number or a
    list of one number per KV head."""
    try:
        data = json.loads(path.read_text())
        per_layer = [[data[key][layer] for key in ("k_scale", "v_scale")] for layer in range(size[0])]
        scales = torch.tensor([[_heads(value, size[2]) for value in pair] for pair in per_layer], dtype=torch.float32)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"kv_cache_scales file {path}: {type(err).__name__}: {err}; it must be JSON "
                         f'{{"k_scale": [...], "v_scale": [...]}} with one entry per layer ({size[0]}), each a '
                         f"number or a list of {size[2]} (one per KV head)") from None
    return _checked(scales, size, str(path))


def _heads(value: float | list[float], heads: int) -> list[float]:
    values = [float(value)] * heads if isinstance(value, int | float) else [float(v) for v in value]
    if len(values) != heads:
        raise ValueError(f"{len(values)} scales for {heads} KV heads")
    return values


def _checked(scales: Tensor, size: tuple[int, int, int], where: str) -> Tensor:
    if tuple(scales.shape) != size:
        raise ValueError(f"KV scales from {where} have shape {list(scales.shape)}, this model needs {list(size)}")
    if not bool(torch.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError(f"KV scales from {where} must be finite and positive")
    return scales
