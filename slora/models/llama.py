"""Llama-family decoder (Llama, Mistral, Qwen2) over the unified paged pool, with batched multi-LoRA.

Every projection is `out = x @ Wᵀ (+ bias)`, then each token's own adapter adds `scaling * x Aᵀ Bᵀ`,
reading A and Bᵀ through the adapter's page table (no copy out of the pool). In decode graphs the LoRA
is a delta computed on a side stream while the GEMM runs, added by the op that reads the projection.

The residual stream rides in the GEMMs that write into it: o_proj and down_proj add their product into the
residual in place (`residual += x @ Wᵀ`, cuBLAS's beta = 1), so the norms after them read one tensor and
write one, instead of reading two and writing two.
"""
from collections.abc import Iterable
from types import MappingProxyType
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slora.adapters.shapes import TargetShapes
from slora.execution.attention_backend import AttentionBackend, RowQueries, row_queries
from slora.execution.lora_backend import LoraStep
from slora.execution.pool_memory import PoolViews
from slora.execution.step_batch import StepBatch
from slora.execution.tensor_parallel import TensorParallel
from slora.kernels.reference import PagedKV
from slora.models import ops
from slora.models.config import ModelConfig
from slora.models.rope import RotaryEmbedding

# The model's LoRA layout: the adapter tables' module axis, in this order, each module's path inside a
# decoder layer `model.layers.{i}` (its Hugging Face name, which adapters' patterns and tensor names use), and
# the groups of consecutive modules that read the same input, whose LoRA is one shrink and one expand
# (q/k/v, gate/up).
LORA_LAYERS_PREFIX = "model.layers"
LORA_MODULE_PATHS = MappingProxyType({
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"})
LORA_MODULES = tuple(LORA_MODULE_PATHS)
Q, K, V, O, GATE, UP, DOWN = range(len(LORA_MODULES))
LORA_GROUPS = (slice(Q, V + 1), slice(O, O + 1), slice(GATE, UP + 1), slice(DOWN, DOWN + 1))
# The last layer's q/k/v group cut in two (Attention.attend_rows): q of the sampled rows, k/v of every row.
LORA_Q, LORA_KV = slice(Q, Q + 1), slice(K, V + 1)


class Projection(Protocol):
    """A projection's weight `[out, in]` and bias `[out]`: an nn.Linear, or a LinearPart of one."""

    @property
    def weight(self) -> Tensor: ...

    @property
    def bias(self) -> Tensor | None: ...


class LinearPart(NamedTuple):
    """Some output features of a projection, as one of their own: views of its weight and bias rows."""
    weight: Tensor               # [out, in]
    bias: Tensor | None          # [out]


def linear_part(linear: nn.Linear, features: slice) -> LinearPart:
    """The output features `features` of `linear`, without a copy."""
    return LinearPart(linear.weight[features], None if linear.bias is None else linear.bias[features])


class Projected(NamedTuple):
    """A projection's output, and its LoRA delta when the op that reads the output adds it."""
    out: Tensor                      # [tokens, out_features]
    lora: ops.Delta | None = None

    def rows(self, rows: Tensor) -> "Projected":
        """These rows of the output, with their delta."""
        lora = self.lora
        return Projected(self.out[rows], None if lora is None else ops.Delta(*(t[rows] for t in lora)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Projected, pdl: bool = False) -> tuple[Tensor, Tensor]:
        """(the normed x, x: the residual stream from here on), x's LoRA delta added first. In float32 like
        Hugging Face's Llama, then the weight in the model's dtype."""
        return ops.rms_norm(x.out, self.weight, self.eps, pdl, x.lora)


class StepContext:
    """What every layer needs in one forward: the batch, the pool, the kernels, the rotary angles; cut to some
    rows (for_rows), those rows as decode queries too."""

    def __init__(self, batch: StepBatch[Tensor], pool: PoolViews, attention: AttentionBackend, lora: LoraStep | None,
                 cos: Tensor, sin: Tensor, rows: RowQueries | None = None, tp: TensorParallel | None = None) -> None:
        self.batch, self.pool, self.attention, self.lora, self.cos, self.sin = batch, pool, attention, lora, cos, sin
        self.rows, self.tp = rows, tp
        self.pdl = attention.pdl

    def project(self, layer: int, modules: slice, x: Tensor, linear: Projection, out_sizes: list[int],
                residual: Tensor | None = None) -> Projected:
        """linear(x) (added into `residual` in place, when given) and each token's LoRA of `modules`
        (consecutive modules reading x, outputs side by side): added into the output after the GEMM, or, when
        the step computes deltas (LoraStep.deltas), returned for the op that reads the output to add (on the
        side stream while the GEMM runs, if there is one)."""
        if self.tp is not None and residual is not None:
            return self._row_parallel(layer, modules, x, linear, out_sizes, residual)
        lora = self.lora
        if lora is None:
            return Projected(_linear(linear, x, residual))
        pool = self.pool.weights[layer]                             # [pages, page_elems]
        if not lora.deltas:
            out = _linear(linear, x, residual)
            lora.apply(layer, modules, x, out, pool, out_sizes)
            return Projected(out)
        if lora.side_stream is None:
            out = _linear(linear, x, residual)
            return Projected(out, self._delta(lora.delta(layer, modules, x, pool, out_sizes)))
        main = torch.cuda.current_stream(x.device)
        lora.side_stream.wait_stream(main)            # x is written
        with torch.cuda.stream(lora.side_stream):
            delta = lora.delta(layer, modules, x, pool, out_sizes)
        out = _linear(linear, x, residual)
        # The op after the GEMM reads the delta: join before anything else is queued. Memory: x and what the
        # side stream allocates before the join stay referenced until then, and the delta (side-stream memory,
        # read on the main stream) can only be reused by a later side-stream allocation, which comes after
        # the next fork, so after the op that reads it. That is why every side-stream allocation must follow
        # a fork (as here, and the Triton step's shrink workspace inside delta()).
        main.wait_stream(lora.side_stream)
        return Projected(out, self._delta(delta))

    def _row_parallel(self, layer: int, modules: slice, x: Tensor, linear: Projection, out_sizes: list[int],
                      residual: Tensor) -> Projected:
        """Under tensor parallelism, o_proj and down_proj: each rank's x and weight hold its input features, so
        its product (LoRA included) is a partial sum, which one all-reduce adds up into the residual stream. The
        residual itself is added on rank 0 alone, so that it counts once."""
        assert self.tp is not None, "called under tensor parallelism"
        if self.tp.rank == 0:
            out = _linear(linear, x, residual)
        else:
            out = torch.mm(x, linear.weight.t(), out=residual)            # [tokens, out]; its bias is rank 0's
        if self.lora is not None:
            self.lora.apply(layer, modules, x, out, self.pool.weights[layer], out_sizes, row_parallel=True)
        return Projected(self.tp.all_reduce(out))

    def for_rows(self, rows: Tensor) -> "StepContext":
        """This context cut to some rows of the step (`rows` `[n]`), for the work of the last layer that only
        the sampled rows need: the LoRA and rotary angles then cover those rows alone, and no LoRA when there
        are none (a chunk step whose prompts all go on). The batch and pool stay the step's. Made before the
        layers: its tensors are read by kernels before their PDL wait (slora.kernels.pdl)."""
        lora = None if self.lora is None or rows.shape[0] == 0 else self.lora.rows(rows)
        return StepContext(self.batch, self.pool, self.attention, lora, self.cos[rows], self.sin[rows],
                           row_queries(self.batch, rows), self.tp)

    def cut(self, x: Tensor) -> Tensor:
        """The rows of x `[tokens, ...]` that this context, made by for_rows, is cut to."""
        assert self.rows is not None, "a context made by for_rows"
        return x[self.rows.rows]

    def _delta(self, delta: Tensor | None) -> ops.Delta | None:
        lora = self.lora
        assert lora is not None, "project() computes deltas only with the step's LoRA"
        return None if delta is None else ops.Delta(delta, lora.token_slots)


def _linear(linear: Projection, x: Tensor, residual: Tensor | None) -> Tensor:
    """linear(x), or, given the residual stream `[tokens, out]`, residual + linear(x) written into it (one GEMM
    that reads the residual in its epilogue, and no copy: torch's out-of-place addmm would copy it first)."""
    if residual is None:
        return F.linear(x, linear.weight, linear.bias)
    out = residual.addmm_(x, linear.weight.t())                  # [tokens, out]
    return out if linear.bias is None else out.add_(linear.bias)


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenated outputs of `parts` (one GEMM instead of several)."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    fused.weight.data = torch.cat([p.weight.data for p in parts])
    if first.bias is not None:
        fused.bias.data = torch.cat([p.bias.data for p in parts])
    return fused


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.qkv_proj: nn.Linear | None = None
        self.scale = self.head_dim ** -0.5

    def fuse(self) -> None:
        """Replace q/k/v by one fused projection (after the checkpoint is loaded)."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def stored_qkv(self, x: Tensor, kv: PagedKV, ctx: StepContext) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (rotated by position) and v, `[tokens, heads, head_dim]` each, from the fused projection; k
        and v stored into the step's slots of the pool by the same kernel that rotates."""
        assert self.qkv_proj is not None, "fuse_projections() runs when the weights are loaded"
        tokens = x.shape[0]
        sizes = [self.q_size, self.kv_size, self.kv_size]
        # One LoRA call for q, k and v, whose columns lie side by side in the fused output.
        qkv = ctx.project(self.layer, LORA_GROUPS[0], x, self.qkv_proj, sizes)   # [tokens, q_size + 2 * kv_size]
        ops.rotary_qk_(qkv.out, ctx.cos, ctx.sin, self.num_heads, self.num_kv_heads, self.head_dim, kv, ctx.pdl,
                       qkv.lora)
        q, k, v = qkv.out.split(sizes, dim=-1)
        return (q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def attend(self, x: Tensor, ctx: StepContext) -> Tensor:
        """Every token's K/V stored, and its attention output `[tokens, q_size]` (before o_proj)."""
        tokens = x.shape[0]
        kv_pool = ctx.pool.kv[self.layer]
        q, k, v = self.stored_qkv(x, ctx.pool.paged_kv(self.layer, ctx.batch.kv_locations, ctx.batch.page_size), ctx)
        attn = ctx.attention.attend(q, (k, v), kv_pool, ctx.batch, self.num_kv_heads, self.scale)
        return attn.reshape(tokens, self.num_heads * self.head_dim)  # [tokens, q_size]

    def attend_rows(self, x: Tensor, ctx: StepContext, rows_ctx: StepContext) -> Tensor:
        """Every token's K/V stored, and the attention output `[rows, q_size]` of the rows of rows_ctx (ctx cut
        to them) alone. Past the last layer's K/V only the sampled rows count: k and v are projected for
        every token (the cache needs them), q for those rows only, which then attend as decode queries."""
        assert self.qkv_proj is not None, "fuse_projections() runs when the weights are loaded"
        assert rows_ctx.rows is not None, "a context cut by for_rows"
        q_part, kv_part = (linear_part(self.qkv_proj, cols) for cols in (slice(0, self.q_size),
                                                                            slice(self.q_size, None)))
        kv_pool = ctx.pool.kv[self.layer]
        kv = ctx.project(self.layer, LORA_KV, x, kv_part, [self.kv_size] * 2)          # [tokens, 2 * kv_size]
        ops.rotary_qk_(kv.out, ctx.cos, ctx.sin, 0, self.num_kv_heads, self.head_dim,
                       ctx.pool.paged_kv(self.layer, ctx.batch.kv_locations, ctx.batch.page_size), ctx.pdl, kv.lora)
        q = rows_ctx.project(self.layer, LORA_Q, rows_ctx.cut(x), q_part, [self.q_size])   # [rows, q_size]
        ops.rotary_qk_(q.out, rows_ctx.cos, rows_ctx.sin, self.num_heads, 0, self.head_dim, None, ctx.pdl, q.lora)
        query = q.out.view(-1, self.num_heads, self.head_dim)                            # [rows, heads, head_dim]
        attn = ctx.attention.attend_rows(query, kv_pool, rows_ctx.rows, ctx.batch.page_size, self.num_kv_heads,
                                         self.scale)
        return attn.reshape(-1, self.q_size)                                             # [rows, q_size]

    def out_proj(self, attn: Tensor, residual: Tensor, ctx: StepContext) -> Projected:
        """residual + o_proj(attn), written into the residual stream, and its LoRA."""
        return ctx.project(self.layer, LORA_GROUPS[1], attn, self.o_proj, [self.o_proj.out_features], residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def activated(self, x: Tensor, ctx: StepContext) -> Tensor:
        """silu(gate) * up `[tokens, intermediate]`, gate and up with each token's LoRA added: one LoRA call
        and one fused activation for both."""
        assert self.gate_up_proj is not None, "fuse_projections() runs when the weights are loaded"
        sizes = [self.intermediate_size] * 2
        gate_up = ctx.project(self.layer, LORA_GROUPS[2], x, self.gate_up_proj, sizes)   # [tokens, 2 * inter]
        return ops.silu_and_mul(gate_up.out, ctx.pdl, gate_up.lora)

    def forward(self, x: Tensor, residual: Tensor, ctx: StepContext) -> Projected:
        """residual + the MLP of x, written into the residual stream, and down_proj's LoRA."""
        hidden = self.activated(x, ctx)                              # [tokens, intermediate]
        return ctx.project(self.layer, LORA_GROUPS[3], hidden, self.down_proj,
                           [self.down_proj.out_features], residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer)

    def forward(self, x: Projected, ctx: StepContext, rows_ctx: StepContext | None = None) -> Projected:
        """The residual stream after this layer, written over x's (with down_proj's LoRA delta, when the step
        computes deltas, for the next norm to add). rows_ctx: ctx cut to some rows (for_rows); every token's
        K/V is stored, but from q on only those rows are computed (and returned)."""
        normed, residual = self.input_layernorm(x, ctx.pdl)         # residual: x with its delta added
        if rows_ctx is None:
            attn = self.self_attn.attend(normed, ctx)                # [tokens, q_size]
        else:
            attn = self.self_attn.attend_rows(normed, ctx, rows_ctx)                 # [rows, q_size]
            residual, ctx = rows_ctx.cut(residual), rows_ctx
        normed, residual = self.post_attention_layernorm(self.self_attn.out_proj(attn, residual, ctx), ctx.pdl)
        return self.mlp(normed, residual, ctx)


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints, so their state dicts load as they are."""

    lora_modules: tuple[str, ...] = LORA_MODULES
    lora_groups: tuple[slice, ...] = LORA_GROUPS
    # Under tensor parallelism, this rank's place: its weights are its part of the model (slora.models.sharding).
    tensor_parallel: TensorParallel | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def lora_targets(self) -> TargetShapes:
        """The shapes and names of this model's LoRA-targetable projections, in the order of `lora_modules`."""
        c = self.config
        h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        features = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                    "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return TargetShapes(c.num_layers, tuple((m, features[m]) for m in self.lora_modules),
                            tuple(LORA_MODULE_PATHS[m] for m in self.lora_modules), LORA_LAYERS_PREFIX)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each; call once the weights are in place."""
        for layer in cast(Iterable[DecoderLayer], self.model.layers):   # nn.ModuleList's items type as Module
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(self, batch: StepBatch[Tensor], pool: PoolViews, attention: AttentionBackend,
                lora: LoraStep | None = None) -> Tensor:
        """Logits `[sampled, vocab]` (float32) of the rows `batch.sample_indices`; `lora`: the step's adapters
        (None: none of its tokens has one)."""
        embedded = self.model.embed_tokens(batch.input_ids)          # [tokens, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, embedded.dtype)
        ctx = StepContext(batch, pool, attention, lora, cos, sin, tp=self.tensor_parallel)
        rows = batch.sample_indices
        # Past the last layer's K/V nothing reads a row that is not sampled, and in a step with prefill rows
        # that is nearly all of them (8,192 tokens, 8 sampled): its q, attention, o_proj and MLP run on the
        # sampled rows, each attending as a decode query. No more rows than sequences, as in a decode step: a
        # step of prompt logprobs, whose rows are most of its tokens, runs the layer whole.
        cut = rows.shape[0] < batch.input_ids.shape[0] and rows.shape[0] <= batch.context_lens.shape[0]
        rows_ctx = ctx.for_rows(rows) if cut else None               # before the layers: see for_rows
        x = Projected(embedded)
        *layers, last = cast(list[DecoderLayer], list(self.model.layers))
        for layer in layers:
            x = layer(x, ctx)
        x = last(x, ctx).rows(rows) if rows_ctx is None else last(x, ctx, rows_ctx)     # [sampled, hidden]
        normed, _ = self.model.norm(x, ctx.pdl)                                         # [sampled, hidden]
        return self.lm_head(normed).float()
