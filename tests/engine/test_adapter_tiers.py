"""Adapter tiers: disk -> host cache (LRU by bytes) -> pool, background reads that block no one."""
import os
import shutil
import threading
import time

import pytest
from tiny import random_prompts

from slora import LLM, SamplingParams
from slora.config import EngineConfig, physical_memory_bytes

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def host_cache_for_one_large_adapter(setup) -> LLM:
    """300 KB of host cache: the rank-16 adapter (256 KB packed) fits, but not beside another one."""
    return LLM(str(setup.model_dir), num_pages=256, adapter_host_cache_gib=300 * 1024 / 2 ** 30)


def reference_tokens(setup, prompts: list[list[int]], adapters: list[str]) -> list[list[int]]:
    """Greedy tokens of an engine whose pool and host cache hold every adapter, each prompt on its adapter."""
    reference = LLM(str(setup.model_dir), num_pages=256)
    for name in dict.fromkeys(adapters):
        reference.load_adapter(name, str(setup.adapters[name]))
    return [output.token_ids for output in reference.generate(prompts, GREEDY, adapters=adapters)]


def test_host_cache_is_lru_by_bytes_and_adapters_come_back_from_disk(tiny_llama):
    llm = host_cache_for_one_large_adapter(tiny_llama)
    engine = llm.engine
    first = llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    second = llm.load_adapter("rs-pattern", str(tiny_llama.adapters["rs-pattern"]))
    assert engine.adapters.versions[first].tier == "disk"           # the older copy made room
    assert engine.adapters.versions[second].tier == "host"
    assert engine.adapters.host_bytes <= engine.adapters.host_cache_bytes
    prompt = random_prompts([14], seed=30)
    [expected] = reference_tokens(tiny_llama, prompt, ["all-r16"])
    assert llm.generate(prompt, GREEDY, adapters=["all-r16"])[0].token_ids == expected
    assert engine.adapters.num_reloads == 1
    engine.check()


def test_an_adapter_read_from_disk_does_not_delay_requests_of_others(tiny_llama):
    llm = host_cache_for_one_large_adapter(tiny_llama)
    engine = llm.engine
    slow = llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    llm.load_adapter("mlp-r8", str(tiny_llama.adapters["mlp-r8"]))
    llm.load_adapter("rs-pattern", str(tiny_llama.adapters["rs-pattern"]))
    assert engine.adapters.versions[slow].tier == "disk"
    gate, real_prepare = threading.Event(), engine.adapters.prepare

    def gated_prepare(path):
        gate.wait(timeout=60)                                   # the disk read takes as long as the test says
        return real_prepare(path)

    engine.adapters.prepare = gated_prepare
    prompts = random_prompts([12, 9], seed=31)
    engine.add_request("needs-disk", prompts[0], GREEDY, "all-r16")     # first in the queue
    engine.add_request("resident", prompts[1], GREEDY, "mlp-r8")
    first_token_step, tokens = {}, {}
    for step in range(1, 6):
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
            first_token_step.setdefault(out.request_id, step)
    # Not delayed by the adapter being read: the first step's token (overlapped, it arrives in the second).
    assert first_token_step["resident"] == 1 + engine.config.async_scheduling
    assert "needs-disk" not in first_token_step
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    expected = reference_tokens(tiny_llama, prompts, ["all-r16", "mlp-r8"])
    assert [tokens["needs-disk"], tokens["resident"]] == expected
    engine.check()


def test_adapter_files_changed_on_disk_fail_its_waiting_requests(tiny_llama, tmp_path):
    folder = tmp_path / "changing"
    shutil.copytree(tiny_llama.adapters["all-r16"], folder)
    llm = host_cache_for_one_large_adapter(tiny_llama)
    engine = llm.engine
    version = llm.load_adapter("changing", str(folder))
    llm.load_adapter("rs-pattern", str(tiny_llama.adapters["rs-pattern"]))
    assert engine.adapters.versions[version].tier == "disk"
    shutil.rmtree(folder)
    shutil.copytree(tiny_llama.adapters["attn-r4"], folder)       # other weights under the same path
    engine.add_request("r", random_prompts([8], seed=32)[0], GREEDY, "changing")
    finished, deadline = {}, time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:   # the read from disk is in the background
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        time.sleep(0.01)
    assert finished["r"].finish_reason == "error"          # not "abort": the server is not shutting down
    assert finished["r"].error.code == "adapter_unavailable"
    assert "changed on disk" in finished["r"].error.message
    assert llm.pool_stats()["kv_pages"] == 0
    engine.check()


def test_host_cache_defaults_to_a_quarter_of_memory():
    assert EngineConfig().adapter_host_cache_bytes == physical_memory_bytes() // 4 > 0
    assert physical_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")   # Linux: no fallback
    assert EngineConfig(adapter_host_cache_gib=0.5).adapter_host_cache_bytes == 2 ** 29
    with pytest.raises(ValueError, match="adapter_host_cache_gib"):
        EngineConfig(adapter_host_cache_gib=-1)


def test_adapters_are_read_back_only_for_requests_near_the_head_of_the_queue(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), num_pages=256, adapter_host_cache_gib=300 * 1024 / 2 ** 30, max_num_seqs=1)
    engine = llm.engine
    on_disk = llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    llm.load_adapter("rs-pattern", str(tiny_llama.adapters["rs-pattern"]))
    stored = engine.adapters.versions[on_disk]
    assert stored.tier == "disk"
    prompts = random_prompts([10, 10], seed=33)
    engine.add_request("first", prompts[0], GREEDY, "rs-pattern")
    engine.add_request("second", prompts[1], GREEDY, "all-r16")      # behind one request, one seat
    engine.step()
    assert stored.reload is None and stored.tier == "disk" and engine.adapters.num_reloads == 0
    engine.step()                                                    # now at the head: its read starts
    assert stored.reload is not None or stored.tier == "host"
    while engine.has_unfinished():
        engine.step()
    assert engine.adapters.num_reloads == 1
    engine.check()


def test_steps_with_every_request_waiting_on_a_disk_read_wait_for_it_instead_of_spinning(tiny_llama):
    """While its only request waits for its adapter to be read back, a step that schedules nothing waits
    (a few ms, or until the read ends) rather than returning at once: a loop of such steps must not spin a
    core for the read's whole length. The request is served once the read ends."""
    llm = host_cache_for_one_large_adapter(tiny_llama)
    engine = llm.engine
    slow = llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    llm.load_adapter("rs-pattern", str(tiny_llama.adapters["rs-pattern"]))
    assert engine.adapters.versions[slow].tier == "disk"
    read_seconds, real_prepare = 0.5, engine.adapters.prepare

    def slow_prepare(path):
        time.sleep(read_seconds)
        return real_prepare(path)

    engine.adapters.prepare = slow_prepare
    engine.add_request("needs-disk", random_prompts([10], seed=33)[0], GREEDY, "all-r16")
    steps, deadline = 0, time.monotonic() + 60
    while engine.adapters.versions[slow].tier == "disk" and time.monotonic() < deadline:
        engine.step()
        steps += 1
    # A step waits up to 5 ms: at most about 100 steps in the read's 0.5 s (spinning made tens of thousands).
    assert engine.adapters.versions[slow].tier != "disk" and steps <= 200, steps
    while engine.has_unfinished() and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_unfinished() and llm.pool_stats()["kv_pages"] == 0


def test_a_version_read_back_from_another_folder_of_the_same_content(tiny_llama, tmp_path):
    """A cluster's replica registered a version from a folder since deleted; told of a copy, it reads that."""
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(tiny_llama.adapters["all-r16"], first)
    shutil.copytree(first, second)
    llm = host_cache_for_one_large_adapter(tiny_llama)
    engine = llm.engine
    version = llm.load_adapter("moved", str(first))
    llm.load_adapter("rs-pattern", str(tiny_llama.adapters["rs-pattern"]))
    assert engine.adapters.versions[version].tier == "disk"
    shutil.rmtree(first)
    engine.adapters.read_back_from(version, second)
    engine.adapters.read_back_from("unknown-version", second)          # ignored
    prompt = random_prompts([9], seed=33)
    [expected] = reference_tokens(tiny_llama, prompt, ["all-r16"])
    assert llm.generate(prompt, GREEDY, adapters=["moved"])[0].token_ids == expected
    assert engine.adapters.num_reloads == 1
    engine.check()
