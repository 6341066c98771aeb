"""Beam search in the engine (DESIGN §3): the best beams equal transformers' beam search + PEFT token for token in
float32 on the tiny model, at several widths, length penalties and stopping rules, mixed in one batch with
plain requests and other adapters; the beams share pages, and the pool's invariants hold after every step,
also under preemption (the group starts over) and aborts."""
import pytest
from tiny import oracle_beam_search, oracle_greedy, random_prompts

from slora import LLM, SamplingParams

NAMES = ["attn-r4", "all-r16"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tiny_llama):
    """The prompts, and stop tokens the searches meet: tokens of the best greedy outputs, so that some beams
    end by a stop token and others by length."""
    prompts = random_prompts([5, 12, 30, 3], seed=3)
    greedy = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts, [None, "attn-r4", "all-r16", None], 8)
    stops = sorted({greedy[0][3], greedy[1][5], greedy[2][2], greedy[3][6]})
    return prompts, stops


def tiny_llm(tiny_llama, **options) -> LLM:
    llm = LLM(str(tiny_llama.model_dir), **options)
    for name in NAMES:
        llm.load_adapter(name, str(tiny_llama.adapters[name]))
    return llm


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return tiny_llm(tiny_llama)


def beam(width: int, stops: list[int], n: int = 1, **options) -> SamplingParams:
    return SamplingParams(use_beam_search=True, beam_width=width, n=n, max_tokens=options.pop("max_tokens", MAX_TOKENS),
                          ignore_eos=True, stop_token_ids=stops, **options)


def oracle(tiny_llama, prompt: list[int], adapter: str | None, params: SamplingParams) -> list[list[int]]:
    return oracle_beam_search(tiny_llama.model_dir, tiny_llama.adapters, prompt, adapter, width=params.num_samples,
                              max_new_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids, n=params.n,
                              length_penalty=params.length_penalty, early_stopping=params.early_stopping)


CASES = [  # (width, n, length_penalty, early_stopping)
    (1, 1, 1.0, False),
    (2, 2, 1.0, False),
    (4, 2, 0.0, True),
    (4, 4, 2.0, "never"),
    (8, 3, -0.5, False),
    (8, 8, 1.0, True),
]


@pytest.mark.parametrize("width,n,length_penalty,early_stopping", CASES)
def test_beams_equal_transformers_beam_search(llm, tiny_llama, setup, width, n, length_penalty, early_stopping):
    prompts, stops = setup
    adapters = [None, "attn-r4", "all-r16", None]
    params = beam(width, stops, n, length_penalty=length_penalty, early_stopping=early_stopping)
    outputs = llm.generate(prompts, params, adapters=adapters)
    for prompt, adapter, out in zip(prompts, adapters, outputs, strict=True):
        want = oracle(tiny_llama, prompt, adapter, params)
        assert [c.token_ids for c in out.outputs] == want, (prompt, adapter)
        assert [c.finish_reason for c in out.outputs] == ["stop" if c[-1] in stops else "length" for c in want]
    llm.engine.check()
    assert llm.engine.pool_stats()["kv_pages"] == 0


def test_some_beams_end_by_a_stop_token(llm, setup):
    """The fixture's stop tokens reach the searches: hypotheses that end early are ranked with the others."""
    prompts, stops = setup
    outputs = llm.generate(prompts, beam(4, stops, 4, max_tokens=12))
    reasons = [c.finish_reason for out in outputs for c in out.outputs]
    assert "stop" in reasons and "length" in reasons


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_beams_mixed_with_plain_requests_in_one_batch(tiny_llama, setup, async_scheduling):
    """Under overlapped scheduling too: a step is scheduled while the last one's tokens are in flight, but a
    beam's next token is known only after its group's selection, so no step runs a beam the selection ended."""
    prompts, stops = setup
    llm = tiny_llm(tiny_llama, async_scheduling=async_scheduling)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    params = [beam(4, stops, 2), greedy, beam(2, stops, 1, length_penalty=0.5), greedy]
    adapters = ["all-r16", "attn-r4", None, "all-r16"]
    outputs = llm.generate(prompts, params, adapters=adapters)
    plain = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, [prompts[1], prompts[3]],
                          [adapters[1], adapters[3]], 8)
    assert [outputs[1].outputs[0].token_ids, outputs[3].outputs[0].token_ids] == plain
    for index in (0, 2):
        want = oracle(tiny_llama, prompts[index], adapters[index], params[index])
        assert [c.token_ids for c in outputs[index].outputs] == want
    llm.engine.check()


def test_cumulative_logprobs_and_token_logprobs(llm, setup):
    """Each beam's cumulative logprob is the sum of its tokens' logprobs, each token among its position's top
    logprobs; the beams come best first by their length-penalized score."""
    prompts, stops = setup
    out = llm.generate(prompts[0], beam(4, stops, 4, logprobs=3))[0]
    for completion in out.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        assert completion.cumulative_logprob == pytest.approx(sum(p.logprob for p in completion.logprobs), abs=1e-4)
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert entry.token_id == token and len(entry.top) == 3
            assert entry.rank > 3 or (token, entry.logprob) in entry.top
    scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
    assert scores == sorted(scores, reverse=True)


def test_forked_beams_share_their_history_pages(tiny_llama, setup):
    """The group's peak pages, as the pool holds them, against the same beams each holding a full copy (the
    sum of their block tables), both read after each schedule, where the forward reads them: forks share the
    prompt and common history, copying only a partial last page on write. Measured: 16 pages at the peak
    against 48 (width 8, a 30-token prompt, 12 tokens)."""
    prompts, stops = setup
    llm = tiny_llm(tiny_llama, page_size=8, async_scheduling=False)
    engine, peaks = llm.engine, {"shared": 0, "unshared": 0}
    schedule = engine.scheduler.schedule

    def schedule_and_count():
        out = schedule()
        tables = [list(s.block_table) for s in engine.scheduler.running]
        peaks["shared"] = max(peaks["shared"], len({p for t in tables for p in t}))
        peaks["unshared"] = max(peaks["unshared"], sum(len(t) for t in tables))
        return out
    engine.scheduler.schedule = schedule_and_count
    engine.add_request("b", prompts[2], beam(8, [], 1, max_tokens=12))
    while engine.has_unfinished():
        engine.step()
        engine.check()
    assert peaks["shared"] <= 0.5 * peaks["unshared"], peaks
    assert engine.pool_stats()["kv_pages"] == 0


def test_beams_never_run_past_max_num_seqs(tiny_llama, setup):
    """Four searches of width 4 under max_num_seqs=8: two groups run at a time, the others wait, and each
    still equals the oracle's."""
    prompts, stops = setup
    llm = tiny_llm(tiny_llama, max_num_seqs=8, max_beam_width=4)
    params = beam(4, stops, 1)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    peak, finished = 0, {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 8
    for i, prompt in enumerate(prompts):
        assert [list(c.token_ids) for c in finished[str(i)].outputs] == oracle(tiny_llama, prompt, None, params)


@pytest.mark.parametrize("mode,adapters,num_pages", [
    ("recompute", [None] * 4, 20),
    ("swap", [None] * 4, 20),
    ("recompute", ["attn-r4", "all-r16", "attn-r4", None], 50),    # an adapter evicted for KV, and back
    ("recompute", [None] * 4, 16),     # room for every prompt but not every group's forks: no group starves
])
def test_preempted_groups_start_over_to_the_same_beams(tiny_llama, setup, mode, adapters, num_pages):
    """A pool too small for every group at once: beams get preempted, their groups start over, and the results
    equal the oracle's; the invariants hold after every step."""
    prompts, stops = setup
    options = {"page_size": 8, "num_pages": num_pages, "watermark": 0.0, "preemption_mode": mode,
               "swap_space_gib": 0.01}
    llm = tiny_llm(tiny_llama, **options) if any(adapters) else LLM(str(tiny_llama.model_dir), **options)
    engine = llm.engine
    params = [beam(4, stops, 2, max_tokens=12) for _ in prompts]
    for index, (prompt, p, name) in enumerate(zip(prompts, params, adapters, strict=True)):
        engine.add_request(str(index), prompt, p, adapter=name)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check()
    assert not engine.has_unfinished() and engine.scheduler.num_preemptions > 0
    if any(adapters):
        assert engine.snapshot().adapter_pool_evictions > 0
    for index, (prompt, name) in enumerate(zip(prompts, adapters, strict=True)):
        assert done[str(index)] == oracle(tiny_llama, prompt, name, params[index])


def test_a_search_the_pool_could_never_hold_is_refused(tiny_llama):
    """Its beams' own pages at their most (each past the prompt) must fit: one that did not would run out and
    start over forever."""
    llm = LLM(str(tiny_llama.model_dir), page_size=8, num_pages=12, watermark=0.0)
    with pytest.raises(ValueError, match="needs 13 pages but the pool has only 12"):
        llm.engine.add_request("big", [5] * 7, SamplingParams(use_beam_search=True, beam_width=4, max_tokens=16))
    assert not llm.engine.has_unfinished() and llm.engine.pool_stats()["kv_pages"] == 0


def test_abort_frees_every_beam(tiny_llama, setup):
    prompts, stops = setup
    llm = tiny_llm(tiny_llama, page_size=8)
    engine = llm.engine
    engine.add_request("b", prompts[2], beam(8, [], 1, max_tokens=40))
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) > 1
    out = engine.abort("b")
    assert out is not None and out.finished
    assert all(c.finish_reason == "abort" for c in out.outputs)
    engine.check()
    assert engine.pool_stats()["kv_pages"] == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("options,message", [
    ({"top_p": 0.5}, "does not support top_p"),
    ({"temperature": 0.7}, "temperature other than 0 or 1"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"stop": ["x"]}, "stop strings"),
    ({"beam_width": 1, "n": 2}, "beam_width must be None or an integer >= n=2"),
    ({"early_stopping": "sometimes"}, "early_stopping must be"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
])
def test_what_beam_search_does_not_combine_with_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(use_beam_search=True, **options)


def test_beam_options_without_beam_search_are_refused():
    with pytest.raises(ValueError, match="length_penalty must be 1.0 without use_beam_search"):
        SamplingParams(length_penalty=2.0)


def test_a_beam_width_past_the_servers_bound_is_refused(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), max_beam_width=4)
    with pytest.raises(ValueError, match="beam width of 5 exceeds the server's max_beam_width=4"):
        llm.engine.add_request("wide", [5, 6, 7], SamplingParams(use_beam_search=True, beam_width=5))
    llm.engine.add_request("ok", [5, 6, 7], SamplingParams(use_beam_search=True, beam_width=4, max_tokens=2))
    assert [len(c.token_ids) for c in llm.generate([[5, 6, 7]], SamplingParams(use_beam_search=True, beam_width=4,
                                                                             n=4, max_tokens=2))[0].outputs] == [2] * 4
