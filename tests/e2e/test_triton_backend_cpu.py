"""The engine's CUDA-path wiring (Triton attention and LoRA backends) run through the Triton interpreter
on the CPU: same greedy tokens as the reference backends, for a mixed-adapter batch with prefill and
decode steps. CUDA graphs need a GPU (tests/e2e/test_gpu_engine.py), but what a mixed-step graph records
runs here uncaptured."""
import dataclasses
import inspect
import os

import pytest
import torch
import triton.language as tl
from tiny import force_lora_deltas, oracle_greedy, random_prompts
from triton.runtime.interpreter import InterpretedFunction

from slora import LLM, SamplingParams
from slora.execution.attention_backend import TritonAttention
from slora.execution.cuda_graphs import GraphLimits
from slora.execution.lora_backend import LoraLaunchPolicy, TritonLora
from slora.execution.mixed_graphs import BucketGraph
from slora.execution.model_runner import WARM_UP_STEPS, WarmUpStep
from slora.execution.step_batch import step_max_rank
from slora.kernels.layout import cdiv

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs Triton kernels in the interpreter, on CPU-only machines")


MATCH_PROMPTS, MATCH_NAMES = random_prompts([3, 18, 9], seed=40), ["all-r16", None, "rs-pattern"]


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama) -> list[list[int]]:
    """The reference backends' greedy tokens of test_triton_backends_match_the_reference_backends, the same for
    each of its cases: the launch policy and the tile constants are the Triton kernels' alone."""
    return _greedy_tokens(tiny_llama, None, MATCH_PROMPTS, MATCH_NAMES)


@pytest.mark.parametrize("policy,narrow_tiles", [
    (LoraLaunchPolicy(), False),
    (LoraLaunchPolicy(accumulate_max_tokens=0, accumulate_max_slots=0), False),
    (LoraLaunchPolicy(accumulate_max_tokens=0, accumulate_max_slots=8, block_m_tokens_per_slot=1), False),
    (LoraLaunchPolicy(), True)])
def test_triton_backends_match_the_reference_backends(tiny_llama, reference_tokens, monkeypatch, policy,
                                                      narrow_tiles):
    """Shrink into one h or split partial sums (by tokens, or by the tables' slots), blocks of 16 or 64
    tokens; narrow_tiles: the kernels' private tile constants at 64 columns (pages chosen per row) and two
    output tiles per expand program."""
    if narrow_tiles:
        from slora.kernels import lora
        for name, value in (("_SHRINK_TILE", 64), ("_EXPAND_TILE", 64), ("_EXPAND_N_TILES", 2)):
            monkeypatch.setattr(lora, name, value)
    assert _greedy_tokens(tiny_llama, policy, MATCH_PROMPTS, MATCH_NAMES) == reference_tokens


def test_gemv_expand_matches_the_reference_backend(tiny_llama, monkeypatch):
    """Decode steps of two sequences on two adapters have a slot per token: with gemv_expand_min_tokens=2 they
    expand with the one-token kernel (rank 16 and the rs-pattern adapter's mixed ranks)."""
    from slora.kernels import lora
    launches = []
    launch = lora._launch_expand_gemv
    monkeypatch.setattr(lora, "_launch_expand_gemv", lambda *args: (launches.append(args), launch(*args))[1])
    policy = LoraLaunchPolicy(gemv_expand_min_tokens=2)
    assert policy.expands_by_gemv(2, 2)
    reference, triton = _greedy_tokens_both_backends(tiny_llama, policy, random_prompts([5, 11], seed=43),
                                                     ["all-r16", "rs-pattern"])
    assert reference == triton
    assert launches, "no step ran the one-token expand"


@pytest.mark.parametrize("gemv", [False, True])
def test_lora_deltas_through_the_triton_kernels_match_the_reference_backend(tiny_llama, monkeypatch, gemv):
    """Every step with LoraStep.deltas, as the decode graphs run: the Triton lora_expand(add=False), default or
    one-token (decode steps of a slot per token: two sequences on two adapters), then the delta added by the
    ops after the projections (their references on the CPU; tests/kernels/test_fused_ops.py tests the fused
    kernels' delta)."""
    layers = force_lora_deltas(monkeypatch)
    from slora.kernels import lora
    adds = []   # the `add` argument of each one-token expand
    launch = lora._launch_expand_gemv
    monkeypatch.setattr(lora, "_launch_expand_gemv", lambda *args: (adds.append(args[-1]), launch(*args))[1])
    policy = LoraLaunchPolicy(gemv_expand_min_tokens=2 if gemv else None)
    names = ["all-r16", "rs-pattern"] + ([] if gemv else [None])
    reference, triton = _greedy_tokens_both_backends(tiny_llama, policy, random_prompts([5, 11, 3][:len(names)],
                                                                                         seed=44), names)
    assert reference == triton
    assert layers, "no step computed a LoRA delta"
    assert (adds and not any(adds)) if gemv else not adds


def _greedy_tokens_both_backends(tiny_llama, policy: LoraLaunchPolicy, prompts: list[list[int]],
                                 names: list[str | None]) -> list[list[list[int]]]:
    """Greedy tokens of the prompts on their adapters with the reference backends, then the Triton ones."""
    return [_greedy_tokens(tiny_llama, None, prompts, names), _greedy_tokens(tiny_llama, policy, prompts, names)]


def _greedy_tokens(tiny_llama, policy: LoraLaunchPolicy | None, prompts: list[list[int]],
                   names: list[str | None]) -> list[list[int]]:
    """Greedy tokens of the prompts on their adapters, from a new engine: on the reference backends (policy
    None) or the Triton ones with this LoRA launch policy."""
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    for name in ("all-r16", "rs-pattern"):
        llm.load_adapter(name, str(tiny_llama.adapters[name]))
    if policy is not None:
        llm.engine.runner.attention, llm.engine.runner.lora = TritonAttention(), TritonLora(policy=policy)
    return [o.token_ids for o in llm.generate(prompts, params, adapters=names)]


def test_lora_launch_policy_rules_and_validation():
    policy = LoraLaunchPolicy(accumulate_max_tokens=64, accumulate_max_slots=4, accumulate_few_max_tokens=256,
                              block_m_tokens_per_slot=16)
    assert policy.accumulates(64, 65) and policy.accumulates(256, 4)
    assert not policy.accumulates(65, 5) and not policy.accumulates(257, 4)
    assert policy.block_m(64, 4) == 64 and policy.block_m(63, 4) == 16 and policy.block_m(16, 0) == 64
    assert policy.expands_by_gemv(128, 128) and not policy.expands_by_gemv(127, 127)   # the default: from 128
    gemv = LoraLaunchPolicy(accumulate_max_tokens=16, accumulate_max_slots=0, gemv_expand_min_tokens=32)
    assert gemv.expands_by_gemv(32, 32) and gemv.expands_by_gemv(256, 300) and not gemv.expands_by_gemv(31, 31)
    assert not gemv.expands_by_gemv(256, 4)   # a few-adapter graph: not a slot per token
    # The one-token expand reads one h: such steps shrink into one whatever their size.
    assert gemv.accumulates(256, 256) and not gemv.accumulates(31, 31) and not gemv.accumulates(256, 4)
    assert not LoraLaunchPolicy(gemv_expand_min_tokens=None).expands_by_gemv(256, 256)
    for bad in ({"accumulate_max_tokens": -1}, {"accumulate_max_slots": -1}, {"accumulate_few_max_tokens": -1},
                {"block_m_tokens_per_slot": 0}, {"gemv_expand_min_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoraLaunchPolicy(**bad)


def test_warm_up_steps_cover_every_lora_launch_choice_of_the_default_policy():
    """Shrink into one h or split partials, in blocks of 16 or 64 tokens: each pair is its own kernel
    variant, and a step of five adapters (block-16 partials) is more than the tiny model's test set has."""
    policy = LoraLaunchPolicy()
    choices = {(policy.accumulates(sum(step.lengths), step.slots), policy.block_m(sum(step.lengths), step.slots))
               for step in WARM_UP_STEPS}
    assert choices == {(accumulate, block_m) for accumulate in (True, False) for block_m in (16, 64)}


def test_warm_up_runs_the_one_token_expand(tiny_llama):
    """A policy with the one-token expand gets warm-up steps of a slot per token, of the rule's first size and
    of the largest batch, so that the kernel compiles at start (CUDA graphs cover decode steps, but eager
    steps of one token per adapter launch it too)."""
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    runner, limits = llm.engine.runner, _limits_for(llm)   # limits.max_batch is 4
    assert runner._warm_up_steps(limits) == WARM_UP_STEPS   # the CPU backends have no policy
    runner.lora = TritonLora()
    assert runner._warm_up_steps(limits) == WARM_UP_STEPS   # the default rule starts at 128 tokens
    for first, extra in ((2, (WarmUpStep(2, 1, 2), WarmUpStep(4, 1, 4))), (4, (WarmUpStep(4, 1, 4),)), (5, ())):
        policy = LoraLaunchPolicy(gemv_expand_min_tokens=first)
        runner.lora = TritonLora(policy=policy)
        steps = runner._warm_up_steps(limits)
        assert steps == WARM_UP_STEPS + extra
        assert all(policy.expands_by_gemv(step.seqs * step.tokens_each, step.slots) for step in extra)
    # At most max_loras adapter slots per step: no step of 3 or more tokens has a slot per token.
    runner.lora = TritonLora(policy=LoraLaunchPolicy(gemv_expand_min_tokens=2))
    assert runner._warm_up_steps(dataclasses.replace(limits, max_loras=2)) == WARM_UP_STEPS + (WarmUpStep(2, 1, 2),)
    runner.lora = TritonLora(policy=LoraLaunchPolicy(gemv_expand_min_tokens=3))
    assert runner._warm_up_steps(dataclasses.replace(limits, max_loras=2)) == WARM_UP_STEPS


def test_warm_up_launches_the_new_kv_kernel_in_both_row_blocks(tiny_llama):
    """Steps below new_kv_min_tokens never launch the new_kv prefill kernel, so the warm-up adds steps of
    at least that many tokens: at least 64 tokens per sequence (row blocks of 64) and fewer (blocks of 32),
    none longer than a sequence may be. A model shorter than new_kv_min_tokens still gets both: its longer
    steps hold several sequences (the benchmarks' 1,025-token engine on 2,048-token steps)."""
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    runner, limits = llm.engine.runner, _limits_for(llm)   # max_batch 4, max_blocks 8
    runner.attention = TritonAttention(new_kv_min_tokens=100)
    page = runner.shape.page_size
    limits = dataclasses.replace(limits, max_blocks=cdiv(100, page))

    def extra(**changes: int) -> tuple[WarmUpStep, ...]:
        return runner._warm_up_steps(dataclasses.replace(limits, **changes))[len(WARM_UP_STEPS):]

    assert extra() == (WarmUpStep(1, 100, 1), WarmUpStep(2, 63, 1))
    assert all(sum(step.lengths) >= 100 for step in extra())
    # default_launch's rule on CUDA: row blocks of 64 when the step has 64 tokens per sequence, else 32.
    assert [sum(step.lengths) >= 64 * step.seqs for step in extra()] == [True, False]
    assert extra(max_batch=1) == extra()[:1]
    # Sequences of at most 80 tokens: two of 64 (128 >= 100 tokens) and two of 63.
    assert extra(max_blocks=80 // page) == (WarmUpStep(2, 64, 1), WarmUpStep(2, 63, 1))
    # Sequences of at most 48 tokens: no step has 64 tokens per sequence.
    assert extra(max_blocks=48 // page) == (WarmUpStep(3, 48, 1),)
    assert extra(max_blocks=48 // page, max_batch=2) == ()


@dataclasses.dataclass
class WarmUpRun:
    """An engine's greedy tokens before and after runner.warm_up, and its pool before and after it."""
    llm: LLM
    before: list[list[int]]
    after: list[list[int]]
    pool_before: torch.Tensor
    pool_after: torch.Tensor


def _warm_up_run(llm: LLM, limits: GraphLimits, recorder: "VariantRecorder | None" = None) -> WarmUpRun:
    """Greedy tokens (a prefill and decode steps, one prompt on an adapter), the warm-up, the same tokens
    again. A recorder skips the launches of those tokens: they are no variants the warm-up knows."""
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = random_prompts([7, 12], seed=41)

    def generate() -> list[list[int]]:
        if recorder is not None:
            recorder.skipping = True
        tokens = [o.token_ids for o in llm.generate(prompts, params, adapters=["all-r16", None])]
        if recorder is not None:
            recorder.skipping = False
        return tokens

    before = generate()
    runner = llm.engine.runner
    pool = runner.memory.contents()
    runner.warm_up(limits)
    pool_after = runner.memory.contents()
    return WarmUpRun(llm, before, generate(), pool, pool_after)


@pytest.fixture(scope="module")
def triton_warm_up(tiny_llama) -> tuple[WarmUpRun, "VariantRecorder"]:
    """The start-up warm-up of an engine on the Triton backends (sized as a CUDA engine of max_num_seqs=16,
    the four test adapters loaded), and the recorder of the kernel variants launched from the engine's
    creation on, except those of the tokens around the warm-up. In the interpreter a warm-up takes most of
    a minute, so the two tests that need one share it: the pool and tokens around it
    (test_warm_up_writes_nothing_and_leaves_generation_unchanged) and the variants it launched
    (test_serving_launches_no_kernel_variant_the_warm_up_did_not)."""
    recorder = VariantRecorder()
    run = InterpretedFunction.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kwargs: (
            recorder.see(self, args, kwargs), run(self, *args, grid=grid, warmup=warmup, **kwargs))[1])
        llm = LLM(str(tiny_llama.model_dir), num_pages=512, max_num_seqs=16)
        for name, path in tiny_llama.adapters.items():
            llm.load_adapter(name, str(path))
        runner = llm.engine.runner
        # A threshold of 100 tokens keeps the new_kv warm-up steps small enough for the interpreter.
        runner.attention, runner.lora = TritonAttention(new_kv_min_tokens=100), TritonLora()
        warm_up = _warm_up_run(llm, llm.engine.sizing.graph_limits(runner.shape), recorder)
    return warm_up, recorder


@pytest.mark.parametrize("triton", [False, True])
def test_warm_up_writes_nothing_and_leaves_generation_unchanged(tiny_llama, triton, request):
    """The CUDA engine's start-up warm-up (prefill and mixed-step kernel variants, adapters at rank 0)
    must not touch the pool: a pool holding KV and adapter pages is the same after it, and greedy tokens
    generated after it are those generated before. (Triton: the warm-up the variant test also uses.)"""
    if triton:
        run, _ = request.getfixturevalue("triton_warm_up")
    else:
        llm = LLM(str(tiny_llama.model_dir), num_pages=64)
        llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
        run = _warm_up_run(llm, _limits_for(llm))
    assert torch.count_nonzero(run.pool_before) > 0       # the pool held KV and adapter pages
    assert torch.equal(run.pool_after, run.pool_before)
    assert run.after == run.before


def _limits_for(llm: LLM) -> GraphLimits:
    """The graph limits a CUDA engine of this model would use (a CPU engine has none)."""
    engine = llm.engine
    rank = engine.config.max_lora_rank
    return GraphLimits(max_batch=4, max_blocks=8, max_adapter_pages=4, max_lora_rank=rank,
                       num_layers=engine.model_config.num_layers, num_lora_modules=len(engine.shapes.modules))


@pytest.mark.parametrize("highest,expected", [(0, 0), (1, 16), (8, 16), (16, 16), (17, 32), (64, 64), (65, 80)])
def test_step_max_rank_is_a_multiple_of_16(highest, expected):
    """Triton specialises ints on divisibility by 16: steps of rank-8 and rank-16 adapters must give the
    LoRA kernels the same kind of max_rank, or each compiles its own variant while serving."""
    assert step_max_rank(highest) == expected


class VariantRecorder:
    """The kernel variants Triton would compile for the launches it sees, emulating its specialisation on
    the GPU: an int argument is specialised on being 1 and on divisibility by 16, a tensor on its data
    pointer's 16-byte alignment, unless the kernel's do_not_specialize(_on_alignment) names it; constexprs
    and launch options by value. A variant first seen while serving is a compile in the middle of a step."""

    def __init__(self) -> None:
        self.seen: set[tuple] = set()
        self.new: list[tuple] = []
        self.checking = False     # after the warm-up: a variant not seen yet is a compile while serving
        self.skipping = False     # a decode step: the GPU replays a graph instead of launching kernels

    def see(self, kernel: InterpretedFunction, args: tuple, kwargs: dict) -> None:
        if self.skipping:
            return
        key = variant_key(kernel, args, kwargs)
        if self.checking and key not in self.seen:
            self.new.append(key)
        self.seen.add(key)


def variant_key(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> tuple:
    params = inspect.signature(kernel.fn).parameters
    unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    key: list[object] = [kernel.fn.__name__]
    for index, (name, value) in enumerate([*zip(kernel.arg_names, args), *sorted(kwargs.items())]):
        if name in params and params[name].annotation is tl.constexpr or name not in params:
            key.append((name, value))
            continue
        fixed = name in unspecialised or index in unspecialised
        aligned = not fixed and name not in unaligned and index not in unaligned
        if isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), aligned and value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            key.append((name, -2 ** 31 <= value < 2 ** 31, not fixed and value == 1, aligned and value % 16 == 0))
        else:
            key.append((name, type(value).__name__))
    return tuple(key)


def test_serving_launches_no_kernel_variant_the_warm_up_did_not(triton_warm_up, monkeypatch):
    """On the GPU, a Triton kernel variant first needed by a prefill or mixed step compiles in the middle of
    serving and stalls that step for up to seconds (docs/decisions.md). The start-up warm-up must launch
    every variant such steps need, whatever their sizes, adapter mixes, ranks and page-table widths. Here
    the variants are emulated on the CPU (VariantRecorder); decode steps are skipped (the GPU replays
    graphs for them, captured at start), so their variants do not count as known. One token per request:
    each request is its prefill step alone (a second token would be a decode step, skipped)."""
    warm_up, recorder = triton_warm_up
    assert recorder.seen and not recorder.checking
    run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kwargs: (
        recorder.see(self, args, kwargs), run(self, *args, grid=grid, warmup=warmup, **kwargs))[1])
    llm = warm_up.llm
    runner = llm.engine.runner
    forward = runner.run
    steps = []

    def checked_run(scheduled, adapters, sampled=None):
        recorder.checking = True
        recorder.skipping = all(item.num_tokens == 1 for item in scheduled)
        steps.append(recorder.skipping)
        return forward(scheduled, adapters, sampled)

    monkeypatch.setattr(runner, "run", checked_run)
    names = ["attn-r4", None, "mlp-r8", "all-r16", "rs-pattern", "all-r16"]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    # Steps of more than accumulate_few_max_tokens tokens on few adapters: split partial sums, 64-token blocks.
    partials = (([300], ["mlp-r8"]), ([150, 150], ["attn-r4", "all-r16"]))
    for seed, (lengths, mix) in enumerate((([1, 9, 17, 40], names[:4]), ([33, 20, 5], names[3:]),
                                           ([12, 30], ["attn-r4", "attn-r4"]), ([70], ["mlp-r8"]), *partials)):
        llm.generate(random_prompts(lengths, seed=50 + seed), params, adapters=mix)
    assert steps and not any(steps), steps      # every step was checked
    assert recorder.new == [], "\n".join(map(str, recorder.new))


def test_the_logprob_kernels_warmed_up_at_top_1_serve_every_top(monkeypatch):
    """The engine compiles the logprob kernels once at start, with top 1; requests then ask for 0 to 20 top
    logprobs, and none of those may compile a variant of its own (Triton specialises ints on == 1 and on
    divisibility by 16 unless told not to)."""
    from slora.kernels.logprobs import MAX_TOP, logprob_rows

    recorder = VariantRecorder()
    run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kwargs: (
        recorder.see(self, args, kwargs), run(self, *args, grid=grid, warmup=warmup, **kwargs))[1])
    logits, tokens = torch.randn(2, 300), torch.tensor([3, 7])
    logprob_rows(logits, tokens, 1)
    recorder.checking = True
    for top in (0, 5, 16, MAX_TOP):
        logprob_rows(logits, tokens, top)
    assert recorder.new == [], "\n".join(map(str, recorder.new))


def test_chunk_steps_that_sample_no_row_match_peft_on_the_triton_kernels(tiny_llama):
    """A prompt chunked 16 tokens a step, alone: its first steps sample no row, so their last layer runs no
    row past its attention; the Triton kernels' tokens are still the oracle's."""
    prompt = random_prompts([40], seed=6)
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompt, ["all-r16"], 3)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64, max_num_batched_tokens=16)
    llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    llm.engine.runner.attention, llm.engine.runner.lora = TritonAttention(), TritonLora()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert llm.generate(prompt, params, adapters=["all-r16"])[0].token_ids == expected[0]


def test_steps_through_a_buckets_recorded_forward_match_peft(tiny_llama, monkeypatch):
    """What a mixed-step graph records (slora.execution.mixed_graphs), run uncaptured on the CPU in place of every replay:
    steps padded to their token bucket (16 or 24 tokens, 4 sequence slots), the attention over the bucket's
    grids, the last layer's sampled rows found in the staged query starts, the sampled rows past the step
    reading row 0. Decodes beside chunks of prompts on two adapters and none: the tokens are the oracle's."""
    from slora.execution.mixed_graphs import ATTENTION_INPUTS, MixedGraphs, packed_length, split_attention_inputs
    prompts, names = random_prompts([50, 3, 9], seed=43), [None, "all-r16", "rs-pattern"]
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 4)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64, max_num_batched_tokens=24)
    for name in ("all-r16", "rs-pattern"):
        llm.load_adapter(name, str(tiny_llama.adapters[name]))
    runner = llm.engine.runner
    runner.attention, runner.lora = TritonAttention(), TritonLora()
    limits = GraphLimits(max_batch=4, max_blocks=8, max_adapter_pages=64, max_lora_rank=16,
                         num_layers=runner.shape.num_layers, num_lora_modules=7, mixed_tokens=24)
    graphs = MixedGraphs(runner.model, runner.memory.views, runner.attention, runner.lora, runner.shape.page_size, limits)
    assert graphs.buckets == [16, 24]

    def recorded(tokens: int, with_lora: bool):
        """The bucket's static inputs, and its forward over them as the capture records it."""
        views = graphs.staged.views(graphs._sizes(tokens), with_lora)
        packed = graphs.staged.device_extra(ATTENTION_INPUTS)[:packed_length(graphs.seqs(tokens))]
        return views, lambda: graphs._record(views.device, split_attention_inputs(packed))

    for tokens in reversed(graphs.buckets):             # as capture() does: the largest bucket first
        for with_lora in (False, True):
            recorded(tokens, with_lora)[1]()
    steps: list[tuple[int, int, int]] = []              # (bucket, the step's tokens, its sampled rows)

    def replay(bucket, host, feed):
        views, forward = recorded(bucket, host.lora is not None)
        graphs.stage(BucketGraph(None, views, torch.zeros(0)), host, feed)
        steps.append((bucket, host.input_ids.shape[0], host.sample_indices.shape[0]))
        return forward()[:len(host.sample_indices)]
    monkeypatch.setattr(graphs, "replay", replay)
    runner.mixed_graphs = graphs
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, adapters=names)] == expected
    # Padded steps whose last layer attends sampled rows alone (fewer than the step's tokens), and a step
    # that samples none.
    assert any(tokens < bucket and 0 < rows < tokens for bucket, tokens, rows in steps), steps
    assert any(rows == 0 for _, _, rows in steps), steps
