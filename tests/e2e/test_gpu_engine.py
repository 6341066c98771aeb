"""The CUDA path (Triton kernels, CUDA graphs) against the CPU engine and transformers + PEFT."""
import pytest
import torch
from tiny import oracle_greedy, random_prompts

from slora import LLM, SamplingParams
from slora.config import CudaConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NAMES = ["attn-r4", None, "mlp-r8", "all-r16", "rs-pattern", None, "all-r16", "attn-r4"]


def make_llm(setup, **kwargs) -> LLM:
    llm = LLM(str(setup.model_dir), num_pages=512, max_num_seqs=16, **kwargs)
    for name, path in setup.adapters.items():
        llm.load_adapter(name, str(path))
    return llm


def tokens(llm: LLM, prompts, names, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, adapters=names)]


@pytest.mark.parametrize("lora_side_stream", [True, False])
def test_cuda_graphs_match_cpu_engine_and_peft_in_float32(tiny_llama, lora_side_stream):
    """Decode graphs with each LoRA on the side stream (added by the next op) or added after its GEMM."""
    prompts = random_prompts([1, 9, 16, 17, 40, 100, 3, 64], seed=11)
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts, NAMES, GREEDY.max_tokens)
    cpu = tokens(make_llm(tiny_llama), prompts, NAMES)
    gpu = make_llm(tiny_llama, device="cuda", dtype="float32", cuda=CudaConfig(lora_side_stream=lora_side_stream))
    graphs = gpu.engine.runner.graphs
    assert graphs is not None and (graphs.side_stream is not None) == lora_side_stream
    assert tokens(gpu, prompts, NAMES) == cpu == expected
    gpu.engine.check()


def test_graph_replay_with_another_adapter_mix_equals_eager(tiny_llama):
    graphs = make_llm(tiny_llama, device="cuda", dtype="float32")
    eager = make_llm(tiny_llama, device="cuda", dtype="float32", cuda=CudaConfig(enforce_eager=True))
    prompts = random_prompts([5, 12, 30, 7, 22], seed=12)
    for mix in (["all-r16"] * 5, [None, "rs-pattern", "attn-r4", None, "mlp-r8"], [None] * 5):
        assert tokens(graphs, prompts, mix) == tokens(eager, prompts, mix)


def test_graphs_captured_for_max_loras_slots_match_cpu(tiny_llama):
    """With max_loras the LoRA grids of the decode graphs are sized for that many adapters, not one per
    sequence; the batch of four adapters then runs at most two at a time, with the CPU engine's tokens."""
    prompts = random_prompts([5, 12, 30, 7, 22, 9, 14, 3], seed=16)
    cpu = tokens(make_llm(tiny_llama), prompts, NAMES)
    gpu = make_llm(tiny_llama, device="cuda", dtype="float32", max_loras=2)
    assert gpu.engine.runner.graphs.limits.adapter_slots(16) == 2
    assert tokens(gpu, prompts, NAMES) == cpu
    gpu.engine.check()


def test_few_adapter_graphs_match_cpu(tiny_llama):
    """Decode steps with at most two adapters replay the graphs captured for two adapter slots, others the
    full ones: all give the CPU engine's tokens."""
    cpu_llm = make_llm(tiny_llama)
    gpu = make_llm(tiny_llama, device="cuda", dtype="float32", cuda=CudaConfig(graph_few_adapters=2))
    graphs = gpu.engine.runner.graphs
    assert (8, True, True) in graphs.graphs and graphs.uses_few(8, 2) and not graphs.uses_few(8, 3)
    replayed = []
    replay = graphs.replay

    def recorded(size, host, batch_size, feed=None):
        adapters = 0 if host.lora is None else host.lora.page_tables.shape[0]
        replayed.append((host.lora is not None, graphs.uses_few(size, adapters)))
        return replay(size, host, batch_size, feed)
    graphs.replay = recorded
    prompts = random_prompts([5, 12, 30, 7, 22], seed=17)
    two = [None, "rs-pattern", "all-r16", None, "rs-pattern"]
    for mix, kind in ((["all-r16"] * 5, (True, True)), (two, (True, True)),
                      (NAMES[:5], (True, False))):     # 4 adapters: the full graphs
        replayed.clear()
        assert tokens(gpu, prompts, mix) == tokens(cpu_llm, prompts, mix)
        assert kind in replayed
    gpu.engine.check()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_tracks_float32(tiny_llama, dtype):
    prompts = random_prompts([20, 33], seed=13)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    half = tokens(make_llm(tiny_llama, device="cuda", dtype=dtype), prompts, ["all-r16", None], params)
    full = tokens(make_llm(tiny_llama, device="cuda", dtype="float32"), prompts, ["all-r16", None], params)
    assert [h[0] for h in half] == [f[0] for f in full]     # the first token is robust to rounding


def test_seeded_sampling_is_the_same_on_cpu_and_cuda(tiny_llama):
    prompts = random_prompts([15], seed=14)
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)
    cpu = tokens(make_llm(tiny_llama), prompts, ["mlp-r8"], params)
    gpu = tokens(make_llm(tiny_llama, device="cuda", dtype="float32"), prompts, ["mlp-r8"], params)
    assert gpu[0][0] == cpu[0][0]


def test_pool_sized_from_free_memory(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), device="cuda", cuda=CudaConfig(gpu_memory_utilization=0.3))
    total = torch.cuda.get_device_properties(0).total_memory
    pool_bytes = llm.engine.runner.memory.nbytes
    assert 0 < pool_bytes < 0.3 * total
    assert llm.pool_stats()["total_pages"] > 1000


def test_memory_torch_keeps_freed_is_not_counted_as_held():
    """What torch's caching allocator keeps after a free is memory a pool can take, though mem_get_info counts
    it as used: the pool's budget subtracts only what is held."""
    from slora.sizing import held_bytes

    device = torch.device("cuda")
    before = held_bytes(device)
    block = torch.empty(4 * 2 ** 30, dtype=torch.uint8, device=device)
    assert held_bytes(device) >= before + 4 * 2 ** 30
    del block
    free, total = torch.cuda.mem_get_info(device)
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= 4 * 2 ** 30
    assert held_bytes(device) <= before + 64 * 2 ** 20 < total - free


def _distinct_copies(adapter_dir, root, count: int) -> list[str]:
    """`count` adapters with the config of `adapter_dir` and B scaled differently: distinct versions."""
    from safetensors.torch import load_file, save_file
    config = (adapter_dir / "adapter_config.json").read_text()
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    paths = []
    for i in range(count):
        folder = root / f"copy-{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(config)
        save_file({k: v * (1 + 0.05 * i) if "lora_B" in k else v for k, v in tensors.items()},
                  str(folder / "adapter_model.safetensors"))
        paths.append(str(folder))
    return paths


def test_many_adapter_loads_and_evictions_match_cpu(tiny_llama, tmp_path):
    """More adapters than fit the pool, many first used in one step (copied on the side stream), evicted
    and loaded again: the same tokens as the CPU engine. The first H200 throughput run died here with a
    device-side assert when a copy's page index was allocated on the wrong stream."""
    names = [f"copy-{i}" for i in range(40)]
    paths = _distinct_copies(tiny_llama.adapters["all-r16"], tmp_path, len(names))
    prompts = random_prompts([4 + i % 23 for i in range(len(names))], seed=15)
    probe = LLM(str(tiny_llama.model_dir), num_pages=512)
    adapter_pages = probe.engine.adapters.prepare(paths[0]).packed.num_pages
    num_pages = 10 * adapter_pages + 16 * 6         # about ten adapters beside 16 sequences' KV

    def run(**kwargs) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(tiny_llama.model_dir), num_pages=num_pages, max_num_seqs=16, **kwargs)
        for name, path in zip(names, paths):
            llm.load_adapter(name, path)
        out = tokens(llm, prompts, names)
        llm.engine.check()
        return out, llm

    cpu, _ = run()
    gpu, llm = run(device="cuda", dtype="float32")
    assert gpu == cpu
    assert llm.engine.adapters.num_evictions > 0


def test_no_kernel_compiles_while_serving(tiny_llama):
    """Graph capture and the start-up warm-up compile every Triton kernel variant that later steps need
    (prefill and mixed steps of other sizes, other adapter mixes and ranks): a compile in the middle of
    serving stalls its step for up to seconds (docs/decisions.md)."""
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("this Triton has no compile hooks (triton.knobs)")
    llm = make_llm(tiny_llama, device="cuda", dtype="bfloat16")
    compiled = []

    def record(**kwargs) -> None:   # returns None: the compile goes ahead
        compiled.append(kwargs.get("repr"))

    triton.knobs.runtime.jit_post_compile_hook = record
    try:
        for seed, lengths in enumerate(([1, 9, 16, 17, 40, 100, 3, 64], [200, 5], [33] * 12)):
            prompts = random_prompts(lengths, seed=20 + seed)
            tokens(llm, prompts, (NAMES * 2)[:len(prompts)])
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert compiled == [], "\n".join(map(str, compiled))


def test_overlapped_scheduling_matches_the_synchronous_engine_on_cuda(tiny_llama):
    """Graphed decode steps fed their input ids on the device, mixed eager steps, forks and seeded samples."""
    prompts = random_prompts([5, 12, 30, 7, 22, 9, 14, 3], seed=18)
    params = [SamplingParams(max_tokens=12, temperature=t, seed=i, n=1 + i % 2, ignore_eos=True)
              for i, t in enumerate([0, 0.8, 0, 1.0, 0, 0.7, 0, 1.2])]
    outputs = []
    for overlap in (False, True):
        llm = make_llm(tiny_llama, device="cuda", dtype="float32", async_scheduling=overlap)
        outputs.append([[s.token_ids for s in o.outputs] for o in llm.generate(prompts, params, adapters=NAMES)])
        llm.engine.check()
    assert outputs[1] == outputs[0]


def test_an_overlapped_step_never_waits_for_the_gpu(tiny_llama):
    """Past the first steps, a decode step (and a mixed one beside a new prompt) queues its forward and
    sampling without a single synchronizing CUDA call: the host then runs a step ahead of the GPU. Only
    the wait for the step before's ids (an event) is allowed."""
    llm = make_llm(tiny_llama, device="cuda", dtype="float32")
    engine = llm.engine
    prompts = random_prompts([9, 14, 3, 20, 6], seed=19)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=1, top_k=40, ignore_eos=True)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", prompt, params, NAMES[i])
    for _ in range(3):
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(6):
            if step == 2:
                engine.add_request("late", prompts[4], params, "mlp-r8")     # a mixed step follows
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
    engine.check()


def staggered_tokens(llm: LLM, prompts, names, params=GREEDY) -> list[list[int]]:
    """Greedy tokens of requests arriving one per step, so prompts (and their chunks) share steps with
    the decodes of earlier ones: mixed steps of many sizes."""
    engine, pending, done = llm.engine, list(enumerate(zip(prompts, names))), {}
    while pending or engine.has_unfinished():
        if pending:
            i, (prompt, name) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params, name)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    engine.check()
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_mixed_step_graphs_match_eager_steps(tiny_llama, monkeypatch):
    """Mixed and prefill steps of up to mixed_graph_tokens tokens replay their bucket's graph: the same
    greedy tokens as eager steps (float32), with adapters of every rank and base rows beside them, decodes
    beside new prompts, and a 700-token prompt whose chunks go past the largest bucket (eager)."""
    from slora.execution.mixed_graphs import MixedGraphs
    buckets = []
    replay = MixedGraphs.replay
    monkeypatch.setattr(MixedGraphs, "replay",
                        lambda self, bucket, host, feed: (buckets.append(bucket), replay(self, bucket, host, feed))[1])
    prompts = random_prompts([1, 9, 16, 17, 40, 100, 3, 64, 300, 700, 5, 250], seed=23)
    names = (NAMES * 2)[:len(prompts)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eager = make_llm(tiny_llama, device="cuda", dtype="float32", cuda=CudaConfig(enforce_eager=True))
    want = staggered_tokens(eager, prompts, names, params)
    assert not buckets and eager.engine.runner.mixed_graphs is None
    llm = make_llm(tiny_llama, device="cuda", dtype="float32", max_num_batched_tokens=640)
    assert llm.engine.runner.mixed_graphs is not None and llm.engine.runner.mixed_graphs.buckets[-1] == 512
    assert staggered_tokens(llm, prompts, names, params) == want
    assert len(set(buckets)) >= 3, buckets                 # several buckets, with and without adapters


def test_steps_of_a_dropped_bucket_replay_the_next_bucket_kept(tiny_llama, monkeypatch):
    """A bucket whose graph replays slower than a larger one's is dropped at start; here the timing rule's
    verdict drops every bucket under 256 tokens. Their steps pad to a bucket kept, with the same greedy
    tokens as eager steps."""
    from slora.execution import mixed_graphs
    monkeypatch.setattr(mixed_graphs, "buckets_worth_keeping", lambda seconds: [b for b in sorted(seconds) if b >= 256])
    buckets = []
    replay = mixed_graphs.MixedGraphs.replay
    monkeypatch.setattr(mixed_graphs.MixedGraphs, "replay",
                        lambda self, bucket, host, feed: (buckets.append(bucket), replay(self, bucket, host, feed))[1])
    prompts = random_prompts([9, 40, 100, 3, 300, 17], seed=25)
    names = (NAMES * 2)[:len(prompts)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = staggered_tokens(make_llm(tiny_llama, device="cuda", dtype="float32",
                                     cuda=CudaConfig(enforce_eager=True)), prompts, names, params)
    llm = make_llm(tiny_llama, device="cuda", dtype="float32", max_num_batched_tokens=640)
    assert all(usable and min(usable) >= 256 for usable in llm.engine.runner.mixed_graphs.usable.values())
    assert staggered_tokens(llm, prompts, names, params) == want
    assert buckets and min(buckets) >= 256, buckets


def test_mixed_step_graphs_switch_off(tiny_llama):
    llm = make_llm(tiny_llama, device="cuda", dtype="float32", cuda=CudaConfig(mixed_graph_tokens=0))
    assert llm.engine.runner.mixed_graphs is None and llm.engine.runner.graphs is not None
    prompts = random_prompts([9, 40, 3], seed=24)
    assert tokens(llm, prompts, NAMES[:3]) == tokens(make_llm(tiny_llama), prompts, NAMES[:3])
