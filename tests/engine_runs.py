"""Driving an engine through a workload step by step, for the tests that compare the synchronous engine with
the overlapped one (tests/engine/test_async_scheduling.py, tests/engine/test_random_workloads.py)."""
from collections.abc import Callable
from typing import NamedTuple

from slora import LLM, SamplingParams
from slora.core.outputs import RequestOutput
from slora.engine import Engine

ADAPTERS = ("attn-r4", "mlp-r8", "all-r16")


class Outcome(NamedTuple):
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str | None]
    logprobs: list[list[tuple[int, float, int]] | None]
    prompt_logprobs: list[float | None] | None


def outcome(output: RequestOutput) -> Outcome:
    def logprob_rows(sample) -> list[tuple[int, float, int]] | None:  # noqa: ANN001 - a CompletionOutput
        if sample.logprobs is None:
            return None
        return [(lp.token_id, round(lp.logprob, 4), lp.rank) for lp in sample.logprobs]
    prompt = None if output.prompt_logprobs is None else \
        [None if lp is None else round(lp.logprob, 4) for lp in output.prompt_logprobs]
    return Outcome([s.token_ids for s in output.outputs], [s.text for s in output.outputs],
                   [s.finish_reason for s in output.outputs], [logprob_rows(s) for s in output.outputs], prompt)


def make_llm(tiny_llama, async_scheduling: bool, **config: object) -> LLM:  # noqa: ANN001 - the fixture
    llm = LLM(str(tiny_llama.model_dir), async_scheduling=async_scheduling, **{"num_pages": 256, **config})
    for name in ADAPTERS:
        llm.load_adapter(name, str(tiny_llama.adapters[name]))
    return llm


class Request(NamedTuple):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter: str | None = None
    arrives: int = 0                 # the step before which it is added


def reload_adapter(llm: LLM, tiny_llama, step: int) -> None:  # noqa: ANN001 - the fixture
    """Unload one of the test adapters (by the step) and load it again: requests running on it keep it."""
    name = ADAPTERS[step % len(ADAPTERS)]
    llm.unload_adapter(name)
    llm.load_adapter(name, str(tiny_llama.adapters[name]))


def drive(engine: Engine, requests: list[Request], abort_at_tokens: dict[str, int] | None = None,
          max_steps: int = 500, before_step: Callable[[int], None] | None = None) -> dict[str, Outcome]:
    """Step the engine until every request ends, adding each at its step and aborting one once its stream
    shows that many tokens, with the pool's invariants checked after every step; the final outcome of each
    request. `before_step(step)` runs before each step's requests are added."""
    finals: dict[str, Outcome] = {}
    abort_at_tokens = abort_at_tokens or {}
    for step in range(max_steps):
        if before_step is not None:
            before_step(step)
        for request in requests:
            if request.arrives == step:
                engine.add_request(request.request_id, request.prompt, request.params, request.adapter)
        if step > max(r.arrives for r in requests) and not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = outcome(out)
            elif len(out.outputs[0].token_ids) >= abort_at_tokens.get(out.request_id, 1 << 30):
                finals[out.request_id] = outcome(engine.abort(out.request_id))
        engine.check()
    assert not engine.has_unfinished(), "the engine did not finish"
    assert engine.pool_stats()["kv_pages"] == 0, "KV pages leaked"
    return finals
