"""Llama-family decoder (Llama, Mistral, Qwen2) over the unified paged pool, with batched multi-LoRA.

Every projection is `out = x @ Wᵀ (+ bias)`, then each token's own adapter adds `scaling * x Aᵀ Bᵀ`,
reading A and Bᵀ through the adapter's page table (no copy out of the pool).
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slora.forward_batch import AttentionOps, ForwardBatch
from slora.kernels.layout import LORA_MODULES
from slora.models.config import ModelConfig
from slora.models.rope import RotaryEmbedding, apply_rotary

Q, K, V, O, GATE, UP, DOWN = range(len(LORA_MODULES))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class StepContext:
    """What every layer needs in one forward: the batch, the pool, the kernels, the rotary angles."""

    def __init__(self, batch: ForwardBatch, pool: Tensor, attention: AttentionOps, cos: Tensor,
                 sin: Tensor) -> None:
        self.batch, self.pool, self.attention, self.cos, self.sin = batch, pool, attention, cos, sin

    def lora(self, layer: int, module: int, x: Tensor, out: Tensor) -> Tensor:
        if self.batch.lora is not None:
            self.batch.lora.apply(layer, module, x, out, self.pool[layer])
        return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        tokens = x.shape[0]
        q = ctx.lora(self.layer, Q, x, self.q_proj(x)).view(tokens, self.num_heads, self.head_dim)
        k = ctx.lora(self.layer, K, x, self.k_proj(x)).view(tokens, self.num_kv_heads, self.head_dim)
        v = ctx.lora(self.layer, V, x, self.v_proj(x)).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        kv_pool = ctx.pool[self.layer]                               # [pages, page_elems]
        ctx.attention.store_kv(k, v, kv_pool, ctx.batch.slot_mapping, ctx.batch.page_size)
        attn = ctx.attention.attend(q, kv_pool, ctx.batch, self.num_kv_heads, self.scale)
        attn = attn.reshape(tokens, self.num_heads * self.head_dim)  # [tokens, q_size]
        return ctx.lora(self.layer, O, attn, self.o_proj(attn))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        gate = ctx.lora(self.layer, GATE, x, self.gate_proj(x))
        up = ctx.lora(self.layer, UP, x, self.up_proj(x))
        hidden = F.silu(gate) * up                                   # [tokens, intermediate]
        return ctx.lora(self.layer, DOWN, hidden, self.down_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer)

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints, so their state dicts load as they are."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: Tensor, attention: AttentionOps) -> Tensor:
        """Logits `[sampled, vocab]` (float32) of the rows `batch.sample_indices`."""
        x = self.model.embed_tokens(batch.input_ids)                 # [tokens, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        ctx = StepContext(batch, pool, attention, cos, sin)
        for layer in self.model.layers:
            x = layer(x, ctx)
        x = self.model.norm(x[batch.sample_indices])                 # [sampled, hidden]
        return self.lm_head(x).float()
