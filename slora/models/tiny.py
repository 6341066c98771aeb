"""`slora-tiny-llama`: a tiny random-weight Llama-architecture model, its tokenizer and three random demo
adapters, made deterministically (fixed seeds) into the cache folder on first use. It answers in gibberish;
it is there for fast tests and benchmarks of the machinery, not for people."""
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slora.models.cache import build_once, cache_root

logger = logging.getLogger(__name__)

TINY_VERSION = "v1"
# Text the byte-level BPE merges are learned from: enough to give common English pieces.
_CORPUS = """slora serves one base model and thousands of LoRA fine-tunes of it, for many customers at once.
Requests for different adapters are batched into the same forward pass. The key and value cache and the
adapter weights live in one paged memory pool, so memory one tenant is not using can hold another's
tokens. Hello, how are you today? I am fine, thank you. The quick brown fox jumps over the lazy dog.
Once upon a time there was a model that answered questions about support tickets, billing and code.
"""
DEMO_ADAPTERS = {  # name -> (rank, target modules, alpha, seed)
    "demo-r4-attn": (4, ["q_proj", "k_proj", "v_proj", "o_proj"], 8, 1),
    "demo-r8-mlp": (8, ["gate_proj", "up_proj", "down_proj"], 16, 2),
    "demo-r16-all": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, 3),
}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class TinyModelPaths:
    model_dir: Path
    adapters: dict[str, Path]


def ensure_tiny_model() -> TinyModelPaths:
    """The tiny model and its demo adapters, made in the cache on first use."""
    root = build_once(cache_root() / f"tiny-{TINY_VERSION}", _build)
    return TinyModelPaths(root / "model", {n: root / "adapters" / n for n in DEMO_ADAPTERS})


def _build(folder: Path) -> None:
    logger.info("creating the tiny model")
    build_tiny_model(folder / "model", seed=0)
    for name, (rank, targets, alpha, seed) in DEMO_ADAPTERS.items():
        build_demo_adapter(folder / "model", folder / "adapters" / name, rank, targets, alpha, seed)


def build_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer learned from the tiny corpus, saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def build_tiny_model(folder: Path, seed: int, architecture: str = "llama", **overrides: Any) -> None:
    """A random-weight model of the Llama family (with the tiny tokenizer) saved as safetensors."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = classes[architecture]
    build_tokenizer(folder)
    settings: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                    bos_token_id=0, eos_token_id=1, initializer_range=0.1, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    model.save_pretrained(str(folder), safe_serialization=True)


def build_demo_adapter(model_dir: Path, folder: Path, rank: int, targets: list[str], alpha: float, seed: int,
                       **lora_kwargs: Any) -> None:
    """A PEFT LoRA adapter with random non-zero A and B for the model in `model_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    # peft annotates lora_alpha as int; it only enters the scaling, lora_alpha / r (or / sqrt(r)): a float works.
    config = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                        target_modules=targets, init_lora_weights=False, **lora_kwargs)
    get_peft_model(base, config).save_pretrained(str(folder), safe_serialization=True)
