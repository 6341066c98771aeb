"""Overlapped scheduling (EngineConfig.async_scheduling): a step's sampled ids stay on the device as the next
step's inputs and reach the host one step later. Every output must equal the synchronous engine's, under
preemption, aborts, stop strings, grammars, forks and adapter eviction, and no page may leak."""
import pytest
import torch
from engine_runs import ADAPTERS, Outcome, Request, drive, make_llm
from tiny import random_prompts

from slora import LLM, SamplingParams
from slora.core.scheduler import ScheduledSeq
from slora.core.sequence import BlockTable, Sequence
from slora.execution.step_batch import build, feed_tokens, token_feed
from slora.sampling.structured_output import StructuredOutput


def both(tiny_llama, requests: list[Request], **config: object) -> tuple[dict[str, Outcome], dict[str, Outcome]]:  # noqa: ANN001
    """The outcomes of the synchronous engine, then of the overlapped one, on the same requests."""
    return tuple(drive(make_llm(tiny_llama, mode, **config).engine, requests) for mode in (False, True))


def mixed_requests(count: int, seed: int = 0, max_tokens: int = 12,
                   adapters: tuple[str | None, ...] = (None, *ADAPTERS)) -> list[Request]:
    """Requests of every kind of sampling, on three adapters and the base model, arriving over the first steps."""
    prompts = random_prompts([5 + (7 * i) % 23 for i in range(count)], seed=seed)
    kinds = [
        dict(temperature=0),
        dict(temperature=0.9, top_k=20, top_p=0.9, seed=3),
        dict(temperature=1.0, seed=4, n=3),
        dict(temperature=1.0, seed=5, n=2, best_of=3),
        dict(temperature=0, logprobs=3, prompt_logprobs=2),
        dict(temperature=0.7, seed=6, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        dict(temperature=0, min_tokens=6, logit_bias={7: 2.0}),
        dict(temperature=0, stop_token_ids=[17, 33, 101]),
        dict(temperature=1.2, seed=7, min_p=0.05, ignore_eos=False),
        dict(temperature=1.0, seed=8, structured=StructuredOutput("choice", ("yes", "no", "maybe"))),
    ]
    requests = []
    for i, prompt in enumerate(prompts):
        kind = {"ignore_eos": True, "max_tokens": max_tokens, **kinds[i % len(kinds)]}
        if "structured" in kind:
            kind["ignore_eos"] = False
        adapter = adapters[i % len(adapters)]
        requests.append(Request(f"r{i}", prompt, SamplingParams(**kind), adapter, arrives=i // 3))
    return requests


def test_outputs_equal_the_synchronous_engine_over_every_kind_of_sampling(tiny_llama):
    sync, overlapped = both(tiny_llama, mixed_requests(12))
    assert overlapped == sync
    assert {o.finish_reasons[0] for o in sync.values()} >= {"length", "stop"}     # both ends were reached


def test_outputs_equal_under_chunked_prefill_beside_decodes(tiny_llama):
    sync, overlapped = both(tiny_llama, mixed_requests(8, seed=1, max_tokens=8), max_num_batched_tokens=16)
    assert overlapped == sync


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_equal_under_preemption(tiny_llama, mode):
    # KV alone overflows the pool (the small adapter stays): sequences are preempted, none thrashes adapters.
    requests = mixed_requests(10, seed=2, max_tokens=16, adapters=(None, "attn-r4"))
    engines = [make_llm(tiny_llama, overlap, page_size=8, num_pages=40, watermark=0.0, preemption_mode=mode).engine
               for overlap in (False, True)]
    sync, overlapped = (drive(engine, requests) for engine in engines)
    assert overlapped == sync
    assert all(engine.scheduler.num_preemptions > 0 for engine in engines), "the pool never ran short"


def test_outputs_equal_while_adapters_are_evicted_and_loaded_again(tiny_llama):
    # A pool that holds one adapter beside the running KV: every change of adapter evicts the last one.
    requests = [Request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        ADAPTERS[i % 3], arrives=i)
                for i, prompt in enumerate(random_prompts([9, 6, 11, 7], seed=3))]
    engines = [make_llm(tiny_llama, overlap, page_size=8, num_pages=48, max_num_seqs=2, watermark=0.0).engine
               for overlap in (False, True)]
    sync, overlapped = (drive(engine, requests) for engine in engines)
    assert overlapped == sync
    assert all(engine.adapters.counts().pool_evictions > 0 for engine in engines), "no adapter was evicted"


def test_stop_strings_end_at_the_same_token_and_cut_the_same_text(tiny_llama):
    prompt = random_prompts([12], seed=7)[0]
    reference = make_llm(tiny_llama, False).generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                                              ignore_eos=True))[0]
    stop = reference.text[len(reference.text) // 2:len(reference.text) // 2 + 2]
    requests = [Request("stop", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])),
                Request("other", prompt[:7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    sync, overlapped = both(tiny_llama, requests)
    assert overlapped == sync
    assert sync["stop"].finish_reasons == ["stop"] and stop not in sync["stop"].texts[0]


def test_an_abort_mid_run_leaves_the_others_unchanged_and_frees_its_pages(tiny_llama):
    requests = mixed_requests(9, seed=4, max_tokens=16)
    sync = drive(make_llm(tiny_llama, False).engine, requests)
    engine = make_llm(tiny_llama, True).engine
    overlapped = drive(engine, requests, abort_at_tokens={"r1": 3, "r4": 5})     # drive checks the pool
    for request_id in ("r1", "r4"):
        cut, whole = overlapped[request_id].token_ids[0], sync[request_id].token_ids[0]
        assert overlapped[request_id].finish_reasons == ["abort"] and cut == whole[:len(cut)]
    assert {k: v for k, v in overlapped.items() if k not in ("r1", "r4")} == \
        {k: v for k, v in sync.items() if k not in ("r1", "r4")}


def test_a_sequence_whose_pending_token_ends_it_is_not_scheduled_again(tiny_llama):
    """Its token in flight is its last by length: the step after it would be wasted (and past max_tokens)."""
    prompts = random_prompts([6, 9], seed=5)
    counts = []
    for overlap in (False, True):
        llm = make_llm(tiny_llama, overlap)
        llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
        counts.append(dict(llm.engine.step_stats.tokens))
    assert counts[1] == counts[0] == {"prefill": 15, "decode": 12, "mixed": 0}


def test_the_token_feed_writes_pending_ids_into_their_rows():
    """Decode rows whose token is pending take it from the sampled ids on the device; others keep the host's."""
    def seq(seq_id: int, prompt: list[int], pending_row: int | None) -> Sequence:
        s = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=4), block_table=BlockTable([seq_id]))
        s.num_computed_tokens = len(prompt) - (pending_row is None)
        s.pending_row = pending_row
        return s
    known, fed, prefill, fed_too = seq(0, [5, 6, 7], None), seq(1, [8, 9], 2), seq(2, [1, 2, 3, 4], None), \
        seq(3, [3, 3], 0)
    prefill.num_computed_tokens = 0
    scheduled = [ScheduledSeq(known, 1), ScheduledSeq(fed, 1), ScheduledSeq(prefill, 4), ScheduledSeq(fed_too, 1)]
    batch = build(scheduled, {}, page_size=16).to(torch.device("cpu"))   # fed on the device
    sampled = torch.tensor([40, 41, 42])                              # the step before's ids, by row
    feed_tokens(batch, token_feed(scheduled, sampled))
    assert batch.input_ids.tolist() == [7, 42, 1, 2, 3, 4, 40]
    assert token_feed(scheduled[:1] + scheduled[2:3], None) is None   # nothing pending: no feed
    # The common step: the decode rows first, sampled in the same order before (leading rows, no index).
    first, second = seq(4, [1, 1], 0), seq(5, [2, 2], 1)
    leading = [ScheduledSeq(first, 1), ScheduledSeq(second, 1), scheduled[2]]
    batch = build(leading, {}, page_size=16).to(torch.device("cpu"))
    feed = token_feed(leading, sampled)
    assert feed is not None and feed.rows == [0, 1] and feed.sources == [0, 1]
    feed_tokens(batch, feed)
    assert batch.input_ids.tolist() == [40, 41, 1, 2, 3, 4]


def test_a_step_left_in_flight_when_the_last_request_ends_is_counted_before_generate_returns(tiny_llama):
    """The last request ends on a stop token while its next row is in flight: that step is taken at once,
    not when the next request comes (its time would then include the idle time between)."""
    llm = make_llm(tiny_llama, True)
    prompt = random_prompts([8], seed=6)[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    forwards, run = [], llm.engine.runner.run

    def counted_run(*args):  # noqa: ANN002, ANN202 - ModelRunner.run's own signature
        forwards.append(1)
        return run(*args)
    llm.engine.runner.run = counted_run
    before = sum(llm.engine.step_stats.steps.values())
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[greedy[2]]))[0]
    assert out.token_ids == greedy[:3] and out.finish_reason == "stop"
    assert len(forwards) == 4                           # the prefill, two decodes, and one past the stop
    assert sum(llm.engine.step_stats.steps.values()) - before == len(forwards)


def calls_in_order(llm: LLM) -> list[str]:
    """The engine's add_request and step calls from now on, in order, by name."""
    calls: list[str] = []
    engine, add, step = llm.engine, llm.engine.add_request, llm.engine.step

    def counted_add(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - Engine.add_request's own signature
        calls.append("add")
        return add(*args, **kwargs)

    def counted_step():  # noqa: ANN202
        calls.append("step")
        return step()
    engine.add_request, engine.step = counted_add, counted_step
    return calls


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_generate_launches_a_full_steps_prompts_before_adding_the_rest(tiny_llama, async_scheduling):
    """Once one step's tokens are queued, generate launches that step, and adds the other requests while it
    runs; the outputs are those of each prompt generated alone."""
    prompts = random_prompts([20, 20, 20, 7, 20], seed=8)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    solo = make_llm(tiny_llama, async_scheduling)
    alone = [solo.generate([p], params)[0].token_ids for p in prompts]
    llm = make_llm(tiny_llama, async_scheduling, max_num_batched_tokens=32)
    calls = calls_in_order(llm)
    outputs = llm.generate(prompts, params)
    assert calls[:4] == ["add", "add", "step", "add"]     # 40 tokens queued: past the step's 32
    assert calls.count("add") == len(prompts)
    assert [o.token_ids for o in outputs] == alone
    assert llm.pool_stats()["kv_pages"] == 0


def test_a_bad_request_after_the_first_step_fails_generate_and_leaves_nothing_queued(tiny_llama):
    llm = make_llm(tiny_llama, True, max_num_batched_tokens=32)
    calls = calls_in_order(llm)
    prompts = [*random_prompts([20, 20], seed=9), [5, 100000]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert calls == ["add", "add", "step", "add"]
    assert not llm.engine.has_unfinished()
    assert llm.pool_stats()["kv_pages"] == 0


def test_pinned_buffers_alternate_and_grow_without_aliasing_the_other_buffer():
    from slora.execution.in_flight import PinnedBuffers

    buffers = PinnedBuffers(pin=False)
    first, second = buffers.take(torch.Size([64]), torch.int64), buffers.take(torch.Size([65]), torch.int64)
    assert first.shape == (64,) and second.shape == (65,) and first.dtype == second.dtype == torch.int64
    first.fill_(1)
    second.fill_(2)
    assert first.tolist() == [1] * 64                     # the second take wrote elsewhere
    third = buffers.take(torch.Size([64]), torch.int64)
    assert third.data_ptr() == first.data_ptr()           # two steps later, the first buffer again
    rows = buffers.take(torch.Size([300, 43]), torch.float64)   # logprob rows: past the buffer's size
    assert rows.shape == (300, 43) and rows.dtype == torch.float64
    rows.fill_(3.0)
    assert third.tolist() == [1] * 64                     # it took the second buffer, not the first
    # The grown buffer is kept: the same two storages come round again, with no new allocation.
    assert buffers.take(torch.Size([64]), torch.int64).data_ptr() == first.data_ptr()
    assert buffers.take(torch.Size([300, 43]), torch.float64).data_ptr() == rows.data_ptr()
