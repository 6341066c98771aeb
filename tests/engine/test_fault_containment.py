"""Fault containment: an exception while handling one request fails that request alone (finish_reason
"error" with a RequestError), frees its pages and leaves every other request's tokens as they were; the
engine goes on serving. Also: adapter folders the engine owns are deleted once their version is dropped,
and the bytes on disk of a namespace's adapters."""
import asyncio
import json
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import edit_weights, first_key, random_prompts

import slora.sampling.stopping as stopping_module
from slora import LLM, SamplingParams
from slora.adapters.errors import AdapterError
from slora.core.outputs import RequestOutput
from slora.engine import Engine
from slora.sampling.sampler import DeviceSample

VICTIM = "victim"
FAULT_AT = 2                 # output tokens the victim's first sample has when the injected fault strikes
MAX_TOKENS = 5
PROMPTS = random_prompts([11, 7, 13], seed=50)
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


class Request(NamedTuple):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter: str | None


def requests() -> list[Request]:
    """The victim (seeded, two samples, adapter "a") beside a seeded top-k request on adapter "b" and a greedy
    one on the base model. Fresh parameters each call: a fault may alter the victim's."""
    return [Request(VICTIM, PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, n=2,
                                                       ignore_eos=True), "a"),
            Request("seeded", PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.1, top_k=20, seed=12,
                                                         ignore_eos=True), "b"),
            Request("greedy", PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), None)]


Fault = Callable[[pytest.MonkeyPatch, Engine], None]


def run(engine: Engine, batch: list[Request], fault: Fault | None = None,
        monkeypatch: pytest.MonkeyPatch | None = None) -> dict[str, RequestOutput]:
    """Add the requests (streamed), inject the fault, step until all end; the final output of each."""
    for request in batch:
        engine.add_request(*request)
    if fault is not None:
        fault(monkeypatch, engine)
    finals, deadline = {}, time.monotonic() + 120        # generous: a loaded 2-core machine
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine stopped making progress"
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        time.sleep(0.002)                                # adapters are read back from disk in the background
    return finals


def tokens(output: RequestOutput) -> list[list[int]]:
    return [sample.token_ids for sample in output.outputs]


class Reference(NamedTuple):
    tokens: dict[str, list[list[int]]]
    pool: dict[str, int]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    # No prefix caching: after a run the pool is back to exactly the same counts, whatever ran.
    llm = LLM(str(tiny_llama.model_dir), num_pages=256, enable_prefix_caching=False)
    llm.load_adapter("a", str(tiny_llama.adapters["attn-r4"]))
    llm.load_adapter("b", str(tiny_llama.adapters["mlp-r8"]))
    return llm


@pytest.fixture(scope="module")
def reference(llm) -> Reference:
    finals = run(llm.engine, requests())
    assert all(o.error is None and o.finish_reason == "length" for o in finals.values())
    assert llm.pool_stats()["kv_pages"] == 0
    return Reference({rid: tokens(o) for rid, o in finals.items()}, llm.pool_stats())


# ---- faults injected at each stage, for the victim only ---------------------------------------------------
def fault_in_sampler(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """The sampler raises on any batch holding the victim's rows (its one-by-one rows too: __call__ samples
    through on_device)."""
    real = engine.sampler.on_device

    def on_device(logits: torch.Tensor, seqs: list, *grammars) -> DeviceSample:
        if any(s.request_id == VICTIM and len(s.output_token_ids) == FAULT_AT for s in seqs):
            raise RuntimeError("injected sampler fault")
        return real(logits, seqs, *grammars)
    monkeypatch.setattr(engine.sampler, "on_device", on_device)


def seed_past_int64(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """Not injected: a seed SamplingParams would refuse, set behind its back, overflows the real sampler's
    int64 tensor (the finding of the review) at the victim's first token."""
    monkeypatch.setattr(engine.requests[VICTIM].seqs[0].params, "seed", 2 ** 64)


def fault_in_detokenizer(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    detokenizer = engine.requests[VICTIM].detokenizers[0]
    real = detokenizer.add

    def add(token_id: int) -> str:
        if len(detokenizer.token_ids) == FAULT_AT:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(token_id)
    monkeypatch.setattr(detokenizer, "add", add)


def fault_in_stop_check(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    real = stopping_module.check_stop

    def check_stop(seq, *args):  # noqa: ANN001, ANN002, ANN202 - check_stop's own signature
        if seq.request_id == VICTIM and len(seq.output_token_ids) == FAULT_AT:
            raise IndexError("injected stop-check fault")
        return real(seq, *args)
    monkeypatch.setattr(stopping_module, "check_stop", check_stop)


@pytest.mark.parametrize("fault, stage", [(fault_in_sampler, "sampling"), (seed_past_int64, "sampling"),
                                          (fault_in_detokenizer, "handling"), (fault_in_stop_check, "handling")])
def test_a_fault_at_one_stage_fails_only_that_request(llm, reference, monkeypatch, fault, stage):
    engine = llm.engine
    finals = run(engine, requests(), fault, monkeypatch)
    victim = finals[VICTIM]
    assert victim.finished and victim.error is not None
    assert victim.error.code == "internal_error" and f"internal error while {stage}" in victim.error.message
    assert [s.finish_reason for s in victim.outputs] == ["error", "error"]
    for got, expected in zip(tokens(victim), reference.tokens[VICTIM]):
        assert len(got) < MAX_TOKENS and got == expected[:len(got)]     # what it had, then it stopped
    for request_id in ("seeded", "greedy"):
        assert finals[request_id].error is None and finals[request_id].finish_reason == "length"
        assert tokens(finals[request_id]) == reference.tokens[request_id]
    engine.check()
    assert llm.pool_stats() == reference.pool and reference.pool["kv_pages"] == 0
    assert not engine.requests and all(s.requests == 0 for s in engine.adapters.versions.values())
    monkeypatch.undo()
    again = run(engine, requests())                                      # the engine goes on serving
    assert {rid: tokens(o) for rid, o in again.items()} == reference.tokens


def test_the_step_that_fails_a_request_returns_its_output_with_the_error(llm, reference, monkeypatch):
    engine = llm.engine
    for request in requests():
        engine.add_request(*request)
    fault_in_stop_check(monkeypatch, engine)
    failed_at = None
    for step in range(1, 3 * MAX_TOKENS):
        outputs = {o.request_id: o for o in engine.step()}
        if VICTIM in outputs and outputs[VICTIM].finished:
            failed_at = step
            assert outputs[VICTIM].error.code == "internal_error"
            assert not outputs["greedy"].finished          # the others are still running, and streamed
            break
    # One step per token: the prefill's token, then decodes; overlapped, a step's tokens come in the next.
    assert failed_at == FAULT_AT + engine.config.async_scheduling
    while engine.has_unfinished():
        engine.step()
    engine.check()


def test_a_fault_the_engine_cannot_attribute_to_a_request_is_raised(llm, reference, monkeypatch):
    """A failed forward pass belongs to no request: the engine does not hide it (the server then reports
    itself FAILED)."""
    engine = llm.engine

    def broken_forward(*args: object) -> torch.Tensor:
        raise RuntimeError("injected forward fault")
    monkeypatch.setattr(engine.runner, "run", broken_forward)
    engine.add_request("r", PROMPTS[2], SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(RuntimeError, match="injected forward fault"):
        engine.step()
    monkeypatch.undo()
    engine.abort("r")
    engine.check()
    assert llm.pool_stats() == reference.pool


def test_llm_generate_returns_a_failed_request_beside_the_others(llm, reference, monkeypatch):
    real = stopping_module.check_stop

    def check_stop(seq, *args):  # noqa: ANN001, ANN002, ANN202 - check_stop's own signature
        if seq.prompt_token_ids == PROMPTS[0] and len(seq.output_token_ids) == FAULT_AT:
            raise RuntimeError("injected")
        return real(seq, *args)
    monkeypatch.setattr(stopping_module, "check_stop", check_stop)
    batch = requests()
    outs = llm.generate([r.prompt for r in batch], [r.params for r in batch], adapters=[r.adapter for r in batch])
    assert [o.finish_reason for o in outs] == ["error", "length", "length"]
    assert outs[0].error.code == "internal_error" and outs[1].error is None and outs[2].error is None
    assert [tokens(o) for o in outs[1:]] == [reference.tokens["seeded"], reference.tokens["greedy"]]
    assert not llm.engine.requests and llm.pool_stats() == reference.pool


def test_through_the_engine_thread_a_failed_request_reaches_its_stream_and_the_server_stays_ready(
        llm, reference, monkeypatch):
    from slora.api.async_engine import AsyncEngine, EngineState
    fault_in_stop_check(monkeypatch, llm.engine)
    batch = {r.request_id: r for r in requests()}

    async def scenario() -> dict[str, RequestOutput]:
        front = AsyncEngine(llm.engine)
        front.start()
        while front.state is EngineState.STARTING:
            await asyncio.sleep(0.01)
        streams = [await front.generate(r.request_id, r.prompt, r.params, r.adapter, None) for r in batch.values()]
        finals = {}
        for stream in streams:
            async for output in stream:
                finals[output.request_id] = output
        assert front.state is EngineState.READY and front.health(stall_timeout_s=60) == (True, "ok")
        await front.shutdown(5)
        return finals
    finals = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert finals[VICTIM].finish_reason == "error" and finals[VICTIM].error.code == "internal_error"
    assert tokens(finals["seeded"]) == reference.tokens["seeded"]
    assert tokens(finals["greedy"]) == reference.tokens["greedy"]
    assert llm.pool_stats() == reference.pool


# ---- adapters read back from disk ---------------------------------------------------------------------
def to_float8(engine: Engine, folder: Path, setup) -> None:  # noqa: ANN001 - the tiny_llama fixture
    weights = load_file(str(folder / WEIGHTS))
    save_file({name: t.to(torch.float8_e4m3fn) for name, t in weights.items()}, str(folder / WEIGHTS))


def bad_rank_pattern(engine: Engine, folder: Path, setup) -> None:  # noqa: ANN001
    config = json.loads((folder / CONFIG).read_text())
    config["rank_pattern"] = {"q_proj[": 4}                  # not a valid regular expression
    (folder / CONFIG).write_text(json.dumps(config))


def vanished(engine: Engine, folder: Path, setup) -> None:  # noqa: ANN001
    shutil.rmtree(folder)


def other_weights(engine: Engine, folder: Path, setup) -> None:  # noqa: ANN001
    shutil.rmtree(folder)
    shutil.copytree(setup.adapters["rs-pattern"], folder)


def reader_raises(engine: Engine, folder: Path, setup) -> None:  # noqa: ANN001
    """The read itself raises something that is no adapter error (the engine is this test's alone)."""
    real = engine.adapters.prepare

    def prepare(path: Path):  # noqa: ANN202
        if Path(path) == folder:
            raise KeyError("injected reader fault")
        return real(path)
    engine.adapters.prepare = prepare


@pytest.mark.parametrize("change, words", [
    (to_float8, "could not be read|no longer valid"),        # whether the adapter loader names it or not
    (bad_rank_pattern, "could not be read|no longer valid"),
    (vanished, "no longer valid"),
    (other_weights, "changed on disk"),
    (reader_raises, "could not be read"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_an_adapter_that_cannot_be_read_back_fails_its_requests_alone(tiny_llama, reference, tmp_path, change,
                                                                      words):
    """No host cache: every request reads its adapter back from disk. The victim's adapter files change under
    it; its request fails with adapter_unavailable, not the engine, and not as "abort" (which the HTTP
    layer answers as a shutdown)."""
    folder = tmp_path / "victim-adapter"
    shutil.copytree(tiny_llama.adapters["attn-r4"], folder)
    llm = LLM(str(tiny_llama.model_dir), num_pages=256, enable_prefix_caching=False, adapter_host_cache_gib=0)
    engine = llm.engine
    llm.load_adapter("a", str(folder))
    llm.load_adapter("b", str(tiny_llama.adapters["mlp-r8"]))
    assert {s.tier for s in engine.adapters.versions.values()} == {"disk"}
    change(engine, folder, tiny_llama)
    finals = run(engine, requests())
    victim = finals[VICTIM]
    assert victim.finish_reason == "error" and victim.token_ids == []
    assert victim.error.code == "adapter_unavailable" and re.search(words, victim.error.message)
    assert str(tmp_path) not in victim.error.message                  # no server path in what the client sees
    for request_id in ("seeded", "greedy"):
        assert finals[request_id].error is None and tokens(finals[request_id]) == reference.tokens[request_id]
    engine.check()
    stats = llm.pool_stats()
    assert stats["kv_pages"] == stats["cached_pages"] == 0
    assert not engine.requests and all(s.requests == 0 for s in engine.adapters.versions.values())
    others = [r for r in requests() if r.request_id != VICTIM]
    again = run(engine, others)                                      # the engine goes on serving
    assert {rid: tokens(o) for rid, o in again.items()} == {r.request_id: reference.tokens[r.request_id]
                                                            for r in others}


# ---- adapter folders the engine owns ------------------------------------------------------------------
@pytest.fixture(scope="module")
def store_llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama.model_dir), num_pages=256)


def copy_adapter(tiny_llama, name: str, folder: Path) -> Path:
    shutil.copytree(tiny_llama.adapters[name], folder)
    return folder


def adapter_files_bytes(folder: Path) -> int:
    return (folder / CONFIG).stat().st_size + (folder / WEIGHTS).stat().st_size


def test_an_owned_folder_is_deleted_once_its_version_is_dropped(store_llm, tiny_llama, tmp_path):
    engine = store_llm.engine
    owned = copy_adapter(tiny_llama, "attn-r4", tmp_path / "owned")
    kept = copy_adapter(tiny_llama, "mlp-r8", tmp_path / "not-owned")
    engine.adapters.load("x", owned, owner="t1", owns_files=True)
    engine.adapters.load("y", kept, owner="t1")
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0), "x", owner="t1")
    engine.adapters.unload("x", owner="t1")
    engine.adapters.unload("y", owner="t1")
    assert owned.is_dir()                         # a running request still holds the version
    assert kept.is_dir()
    while engine.has_unfinished():
        engine.step()
    assert not owned.exists() and kept.is_dir()   # only the owned folder goes, with the version
    engine.check()


def test_replacing_an_owned_adapter_deletes_the_replaced_folder(store_llm, tiny_llama, tmp_path):
    engine = store_llm.engine
    first = copy_adapter(tiny_llama, "attn-r4", tmp_path / "first")
    second = copy_adapter(tiny_llama, "mlp-r8", tmp_path / "second")
    engine.adapters.load("x", first, owner="t1", owns_files=True)
    engine.adapters.load("x", second, owner="t1", owns_files=True)
    assert not first.exists() and second.is_dir()
    engine.adapters.unload("x", owner="t1")
    assert not second.exists()


def test_the_same_content_uploaded_twice_leaves_no_folder_behind(store_llm, tiny_llama, tmp_path):
    engine = store_llm.engine
    folders = [copy_adapter(tiny_llama, "all-r16", tmp_path / f"upload-{i}") for i in range(3)]
    engine.adapters.load("x", folders[0], owner="t1", owns_files=True)
    engine.adapters.load("y", folders[1], owner="t2", owns_files=True)       # same version, another tenant
    engine.adapters.load("x", folders[2], owner="t1", owns_files=True)       # same version, same name again
    assert folders[0].is_dir() and not folders[1].exists() and not folders[2].exists()
    engine.adapters.unload("x", owner="t1")
    assert folders[0].is_dir()                    # "y" still names the version, read back from this folder
    engine.adapters.unload("y", owner="t2")
    assert not folders[0].exists()


def test_an_owned_folder_of_a_refused_adapter_is_deleted(store_llm, tiny_llama, tmp_path):
    engine = store_llm.engine
    folder = copy_adapter(tiny_llama, "attn-r4", tmp_path / "refused")
    bad_config = json.loads((folder / CONFIG).read_text()) | {"r": 0}
    (folder / CONFIG).write_text(json.dumps(bad_config))
    with pytest.raises(AdapterError, match="rank"):
        engine.adapters.load("x", folder, owner="t1", owns_files=True)
    assert not folder.exists() and ("t1", "x") not in engine.adapters.names.entries


def test_an_owned_folder_dropped_while_being_read_back_leaves_nothing(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama.model_dir), num_pages=256, adapter_host_cache_gib=0)
    engine = llm.engine
    folder = copy_adapter(tiny_llama, "attn-r4", tmp_path / "owned")
    version = engine.adapters.load("x", folder, owns_files=True).version
    gate, real = threading.Event(), engine.adapters.prepare

    def gated_prepare(path: Path):  # noqa: ANN202
        gate.wait(timeout=60)                     # the read from disk takes as long as the test says
        return real(path)
    engine.adapters.prepare = gated_prepare
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0), "x")
    engine.step()                                 # its adapter's read from disk starts, and waits
    stored = engine.adapters.versions[version]
    assert stored.reload is not None
    engine.adapters.unload("x")
    engine.abort("r")
    assert not folder.exists() and version not in engine.adapters.versions
    gate.set()
    deadline = time.monotonic() + 60
    while stored.reload is not None:              # the read ends (it fails: the folder is gone)
        assert time.monotonic() < deadline, "the read from disk never ended"
        engine.step()
        time.sleep(0.01)
    assert version not in engine.adapters.versions   # not stored back, where nothing would ever drop it
    engine.check()


def test_adapter_disk_bytes_counts_each_version_of_a_namespace_once(store_llm, tiny_llama, tmp_path):
    engine = store_llm.engine
    big = copy_adapter(tiny_llama, "all-r16", tmp_path / "big")
    small = copy_adapter(tiny_llama, "attn-r4", tmp_path / "small")
    big_bytes, small_bytes = adapter_files_bytes(big), adapter_files_bytes(small)
    assert (big / "README.md").is_file()           # a file beside the two is not counted
    engine.adapters.load("one", big, owner="quota")
    engine.adapters.load("two", big, owner="quota")              # the same version under a second name
    engine.adapters.load("three", small, owner="quota")
    engine.adapters.load("theirs", small, owner="other")
    assert engine.adapters.disk_bytes("quota") == big_bytes + small_bytes
    assert engine.adapters.disk_bytes("other") == small_bytes
    assert engine.adapters.disk_bytes("nobody") == 0
    engine.adapters.unload("one", owner="quota")
    assert engine.adapters.disk_bytes("quota") == big_bytes + small_bytes    # "two" still names it
    engine.adapters.unload("three", owner="quota")
    assert engine.adapters.disk_bytes("quota") == big_bytes
    assert engine.adapters.disk_bytes("other") == small_bytes


def test_an_owned_folder_counts_until_it_is_deleted(store_llm, tiny_llama, tmp_path):
    """A replaced or unloaded upload still used by a request keeps its folder on disk: it counts against its
    namespace until it goes, so re-uploading under a running request cannot grow past a byte quota."""
    engine = store_llm.engine
    first = copy_adapter(tiny_llama, "all-r16", tmp_path / "first")
    second = copy_adapter(tiny_llama, "attn-r4", tmp_path / "second")
    for folder in (first, second):             # versions of their own, not the module's earlier ones
        edit_weights(folder, lambda tensors: tensors[first_key(tensors, "lora_A")].mul_(0.5))
    first_bytes, second_bytes = adapter_files_bytes(first), adapter_files_bytes(second)
    engine.adapters.load("x", first, owner="uploader", owns_files=True)
    engine.add_request("held", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0), "x", owner="uploader")
    engine.adapters.load("x", second, owner="uploader", owns_files=True)          # replaced under the request
    assert first.is_dir()
    assert engine.adapters.disk_bytes("uploader") == first_bytes + second_bytes
    assert engine.adapters.disk_bytes("bystander") == 0
    while engine.has_unfinished():
        engine.step()
    assert not first.exists() and engine.adapters.disk_bytes("uploader") == second_bytes
    engine.adapters.unload("x", owner="uploader")
    assert engine.adapters.disk_bytes("uploader") == 0
    engine.check()
