"""Random workloads, drawn by Hypothesis: the overlapped engine ends every request as the synchronous engine
does, and both keep the pool's invariants after every step. A workload mixes chunked prefill, prompts that
share a prefix (on one adapter, on others, and on the base model), preemption by recompute and by swap (with
no swap space too), max_loras, forks, grammars, stop strings, aborts, and adapters unloaded and loaded again
while requests run on them. Small pools make the adapters and the cached pages evict each other."""
from dataclasses import dataclass

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is not installed (the GPU machine's case): pip install hypothesis")

from engine_runs import ADAPTERS, Outcome, Request, drive, make_llm, reload_adapter  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from slora import SamplingParams  # noqa: E402
from slora.sampling.structured_output import StructuredOutput  # noqa: E402

VOCAB = 512                     # the tiny model's
SAMPLING = (
    dict(temperature=0),
    dict(temperature=0.9, top_k=20, top_p=0.9),
    dict(temperature=1.0, n=3),
    dict(temperature=1.0, n=2, best_of=3),
    dict(temperature=0, logprobs=2, prompt_logprobs=1),
    dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    dict(temperature=0, min_tokens=4, logit_bias={7: 2.0}),
    dict(temperature=0, stop_token_ids=[17, 33, 101]),
    dict(temperature=0, stop=["e"]),
    dict(temperature=1.2, min_p=0.05, ignore_eos=False),
    dict(temperature=1.0, structured=StructuredOutput("choice", ("yes", "no", "maybe")), ignore_eos=False),
)
CONFIGS = {
    "page_size": st.sampled_from([8, 16]),
    "num_pages": st.sampled_from([48, 64, 256]),       # 48 pages of 8 tokens: the largest adapter takes 32
    "max_num_seqs": st.sampled_from([3, 8, 32]),
    "max_num_batched_tokens": st.sampled_from([16, 32, 512]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "swap_space_gib": st.sampled_from([1.0, 0.0]),
    "enable_prefix_caching": st.booleans(),
    "max_loras": st.sampled_from([None, 1, 2]),
}


@dataclass
class Workload:
    """What one example runs: its engine settings, requests, aborts (in the overlapped engine: by tokens
    streamed) and the steps before which an adapter is unloaded and loaded again."""
    config: dict[str, object]
    requests: list[Request]
    aborts: dict[str, int]
    reloads: set[int]


tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)


@st.composite
def requests(draw: st.DrawFn, index: int, shared: list[int]) -> Request:
    prompt = shared[:draw(st.integers(0, len(shared)))] + draw(tokens)
    params = {"ignore_eos": True, "max_tokens": draw(st.integers(6, 16)), "seed": draw(st.integers(0, 999)),
              **draw(st.sampled_from(SAMPLING))}
    if params["temperature"] == 0:
        params.pop("seed")
    adapter = draw(st.sampled_from((None, *ADAPTERS)))
    return Request(f"r{index}", prompt, SamplingParams(**params), adapter, arrives=draw(st.integers(0, 8)))


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    config = {name: draw(strategy) for name, strategy in CONFIGS.items()}
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=40))
    count = draw(st.integers(2, 12))
    drawn = [draw(requests(i, shared)) for i in range(count)]
    aborted = draw(st.sets(st.sampled_from([r.request_id for r in drawn]), max_size=2))
    aborts = {request_id: draw(st.integers(1, 6)) for request_id in sorted(aborted)}
    return Workload({**config, "watermark": 0.0}, drawn, aborts, draw(st.sets(st.integers(1, 30), max_size=3)))


def run(tiny_llama, workload: Workload, overlapped: bool) -> dict[str, Outcome]:  # noqa: ANN001 - the fixture
    llm = make_llm(tiny_llama, overlapped, **workload.config)

    def reload_on_its_steps(step: int) -> None:
        if step in workload.reloads:
            reload_adapter(llm, tiny_llama, step)
    return drive(llm.engine, workload.requests, workload.aborts if overlapped else None, max_steps=800,
                 before_step=reload_on_its_steps)


def assert_alike(sync: Outcome, overlapped: Outcome) -> None:
    """The same samples and text; logprobs within 1e-3 (a batch's makeup moves their last float32 bits)."""
    assert (overlapped.token_ids, overlapped.texts, overlapped.finish_reasons) == \
        (sync.token_ids, sync.texts, sync.finish_reasons)
    for got, want in zip(overlapped.logprobs, sync.logprobs):
        assert (got is None) == (want is None)
        if got is not None:
            assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
            assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-3)
    assert (overlapped.prompt_logprobs is None) == (sync.prompt_logprobs is None)
    if sync.prompt_logprobs is not None:
        assert overlapped.prompt_logprobs == pytest.approx(sync.prompt_logprobs, abs=1e-3)


def assert_cut_short(request: Request, cut: Outcome, whole: Outcome) -> None:
    """An aborted request's samples: each a start of the synchronous engine's (unless best_of ranked them
    on partial samples)."""
    assert set(cut.finish_reasons) == {"abort"}
    if request.params.best_of is None:
        assert all(part == full[:len(part)] for part, full in zip(cut.token_ids, whole.token_ids))


@settings(max_examples=24, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=workloads())
def test_random_workloads_end_alike_with_and_without_overlap(tiny_llama, workload: Workload):  # noqa: ANN001
    sync, overlapped = run(tiny_llama, workload, False), run(tiny_llama, workload, True)
    assert sorted(overlapped) == sorted(sync) == sorted(r.request_id for r in workload.requests)
    for request in workload.requests:
        got, want = overlapped[request.request_id], sync[request.request_id]
        if request.request_id in workload.aborts and "abort" in got.finish_reasons:
            assert_cut_short(request, got, want)
        else:
            assert_alike(want, got)
