"""Prefix cache keyed on adapter version and tenant, copy-on-write samples, swap (issue: sharing)."""
import random
import shutil

import numpy as np
import pytest
from tiny import random_prompts

from slora import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def make_llm(setup, **kwargs) -> LLM:
    llm = LLM(str(setup.model_dir), **{"num_pages": 400, "page_size": 16, **kwargs})
    for name, path in setup.adapters.items():
        llm.engine.adapters.load(name, str(path), public=True)      # usable by every tenant
    return llm


def run_requests(llm: LLM, requests: list[tuple], check_every_step: bool = True) -> dict:
    """requests: (request_id, prompt, params, adapter, owner). Steps the engine to the end."""
    engine = llm.engine
    for request_id, prompt, params, adapter, owner in requests:
        engine.add_request(request_id, prompt, params, adapter, owner)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if check_every_step:
            engine.check()
    return done


def test_shared_prefix_is_computed_once_and_outputs_match_cache_off(tiny_llama):
    system = random_prompts([64], seed=20)[0]                   # 4 full pages
    prompts = [system + tail for tail in random_prompts([5, 9, 13, 3, 20, 7], seed=21)]
    requests = [(f"r{i}", p, GREEDY, "all-r16", "tenant-a") for i, p in enumerate(prompts)]
    cached = make_llm(tiny_llama)
    first = run_requests(cached, requests[:1])
    rest = run_requests(cached, requests[1:])
    plain = make_llm(tiny_llama, enable_prefix_caching=False)
    expected = run_requests(plain, requests)
    outputs = {**first, **rest}
    assert {k: o.token_ids for k, o in outputs.items()} == {k: o.token_ids for k, o in expected.items()}
    assert first["r0"].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 64 for o in rest.values())
    tails = sum(len(p) - 64 for p in prompts[1:])
    assert cached.engine.num_prompt_tokens_computed == len(prompts[0]) + tails
    assert plain.engine.num_prompt_tokens_computed == sum(len(p) for p in prompts)


@pytest.mark.parametrize("other", ["adapter", "base", "tenant", "new-version"])
def test_no_sharing_across_adapters_versions_or_tenants(tiny_llama, tmp_path, other):
    prompt = random_prompts([50], seed=22)[0]
    llm = make_llm(tiny_llama)
    run_requests(llm, [("warm", prompt, GREEDY, "mlp-r8", "tenant-a")])
    adapter, owner = {"adapter": ("attn-r4", "tenant-a"), "base": (None, "tenant-a"),
                      "tenant": ("mlp-r8", "tenant-b"), "new-version": ("mlp-r8", "tenant-a")}[other]
    if other == "new-version":                                  # same name, new weights
        changed = tmp_path / "mlp-r8-v2"
        shutil.copytree(tiny_llama.adapters["all-r16"], changed)
        llm.engine.adapters.load("mlp-r8", str(changed), public=True)
    out = run_requests(llm, [("probe", prompt, GREEDY, adapter, owner)])["probe"]
    assert out.num_cached_tokens == 0
    fresh = make_llm(tiny_llama, enable_prefix_caching=False)
    if other == "new-version":
        fresh.engine.adapters.load("mlp-r8", str(tmp_path / "mlp-r8-v2"), public=True)
    assert out.token_ids == run_requests(fresh, [("probe", prompt, GREEDY, adapter, owner)])["probe"].token_ids


def peak_kv_pages(llm: LLM, requests: list[tuple]) -> int:
    engine, peak = llm.engine, 0
    for request_id, prompt, params, adapter, owner in requests:
        engine.add_request(request_id, prompt, params, adapter, owner)
    while engine.has_unfinished():
        engine.step()
        engine.check()
        peak = max(peak, llm.pool_stats()["kv_pages"])
    return peak


def test_n_samples_share_the_prompt_pages_copy_on_write(tiny_llama):
    prompt = random_prompts([40], seed=23)[0]                   # 2 full pages + 8 tokens in a third
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=100, n=8, ignore_eos=True)
    forked = peak_kv_pages(make_llm(tiny_llama), [("fork", prompt, params, "attn-r4", None)])
    separate = peak_kv_pages(make_llm(tiny_llama, enable_prefix_caching=False),
                             [(f"s{i}", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=100 + i,
                                                                 ignore_eos=True), "attn-r4", None)
                              for i in range(8)])
    # 40 + 4 tokens fit in 3 pages: the samples share the 2 full pages and each writes its own copy
    # of the partial page (the parent keeps the original): 2 + 8, against 8 x 3 separately.
    assert forked == 2 + 8
    assert separate == 8 * 3


def test_each_of_n_samples_equals_a_run_alone_with_its_seed(tiny_llama):
    prompt = random_prompts([21], seed=24)[0]
    llm = make_llm(tiny_llama)
    together = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=8,
                                                     ignore_eos=True), adapters=["rs-pattern"])[0]
    alone = make_llm(tiny_llama, enable_prefix_caching=False)
    for i, sample in enumerate(together.outputs):
        single = alone.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i,
                                                         ignore_eos=True), adapters=["rs-pattern"])[0]
        assert sample.token_ids == single.token_ids
    assert len({tuple(s.token_ids) for s in together.outputs}) > 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_and_recompute_equal_no_preemption(tiny_llama, mode):
    prompts = random_prompts([30, 45, 20, 38, 27, 50], seed=25)
    names = ["attn-r4", "mlp-r8", None, "attn-r4", None, "mlp-r8"]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)] * 3
    requests = [(f"r{i}", p, sp, n, None) for i, (p, sp, n) in enumerate(zip(prompts, params, names))]
    expected = run_requests(make_llm(tiny_llama, enable_prefix_caching=False), requests)
    adapters = {n: tiny_llama.adapters[n] for n in ("attn-r4", "mlp-r8")}
    tight = LLM(str(tiny_llama.model_dir), num_pages=44, page_size=8, watermark=0.0, preemption_mode=mode,
                enable_prefix_caching=False, swap_space_gib=0.01)
    for name, path in adapters.items():
        tight.engine.adapters.load(name, str(path), public=True)
    outputs = run_requests(tight, requests)
    assert tight.engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert tight.engine.scheduler.num_swaps > 0
    assert {k: o.token_ids for k, o in outputs.items()} == {k: o.token_ids for k, o in expected.items()}


def test_random_stress_keeps_outputs_and_invariants(tiny_llama, tmp_path):
    rng = random.Random(0)
    names = list(tiny_llama.adapters) + [None]
    prefixes = random_prompts([16, 32], seed=26)
    requests = []
    for i in range(18):
        prompt = rng.choice(prefixes + [[]]) + random_prompts([rng.randint(1, 30)], seed=100 + i)[0]
        n = rng.choice([1, 1, 2, 3])
        params = SamplingParams(max_tokens=rng.randint(2, 8), temperature=rng.choice([0, 0.7]), seed=i, n=n,
                                ignore_eos=True)
        requests.append((f"r{i}", prompt, params, rng.choice(names), rng.choice(["t1", "t2"])))
    expected = {}
    for request in requests:                                   # each request alone, roomy pool, no cache
        expected.update(run_requests(make_llm(tiny_llama, enable_prefix_caching=False), [request], False))
    # Room for about one large adapter beside the KV: adapters are evicted and reloaded all the time.
    llm = make_llm(tiny_llama, num_pages=60, page_size=8, watermark=0.0)
    engine, done, aborted = llm.engine, {}, set()
    for request in requests[:10]:
        engine.add_request(*request)
    step = 0
    while engine.has_unfinished() or step < 12:
        step += 1
        if step == 4:
            engine.abort("r3")
            aborted.add("r3")
        if step == 6:                                           # hot reload under a running name
            llm.load_adapter("spare", str(tiny_llama.adapters["mlp-r8"]))
            llm.unload_adapter("spare")
        if step == 8:
            for request in requests[10:]:
                engine.add_request(*request)
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check()
    for request_id, output in done.items():
        if request_id in aborted:
            continue
        assert [s.token_ids for s in output.outputs] == [s.token_ids for s in expected[request_id].outputs]
    assert engine.adapters.num_evictions > 0
    for name in tiny_llama.adapters:
        llm.unload_adapter(name)
    stats = llm.pool_stats()
    assert stats["kv_pages"] == stats["adapter_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]
    engine.check()


def _page_hash(parent: bytes | None, token_ids: list[int], adapter_version: str | None, salt: bytes) -> bytes:
    """One page's hash as prefix_cache's docstring defines it, field by field."""
    import hashlib
    import struct

    fields = (parent or b"", struct.pack(f"<{len(token_ids)}q", *token_ids), (adapter_version or "").encode(), salt)
    return hashlib.sha256(b"".join(struct.pack("<Q", len(f)) + f for f in fields)).digest()


def test_extend_hashes_is_page_hash_chained_over_every_full_page():
    """The chain hashes the tokens packed once; each link is still the documented hash of its page (the digest
    kept), continued from a chain already known, and distinct for another adapter version or tenant salt."""
    from slora.core.prefix_cache import extend_hashes

    rng = random.Random(7)
    tokens = [rng.randrange(200_000) for _ in range(70)]                   # 4 full pages and 6 tokens
    want, parent = [], None
    for first in range(0, 64, 16):
        parent = _page_hash(parent, tokens[first:first + 16], "v1", b"tenant-a")
        want.append(parent)
    assert extend_hashes([], tokens, 16, "v1", b"tenant-a") == want
    # The scheduler passes a prompt's int32 array: its ids are packed as int64 all the same.
    assert extend_hashes([], np.array(tokens, dtype=np.int32), 16, "v1", b"tenant-a") == want
    known = extend_hashes([], tokens[:40], 16, "v1", b"tenant-a")
    assert known == want[:2] and extend_hashes(known, tokens[32:], 16, "v1", b"tenant-a") == want
    assert extend_hashes([], tokens, 16, None, b"tenant-a")[0] != want[0]
    assert extend_hashes([], tokens, 16, "v1", b"tenant-b")[0] != want[0]
