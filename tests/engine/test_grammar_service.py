"""Grammar compiles off the engine's thread (slora.sampling.grammar_service) with the default model's tokenizer: a spec
compiles in a worker process to the same grammar as in-process; a compile bomb is stopped at its time budget
and the worker serves the next compile; an oversized grammar is refused by its size; a compile nobody waits
for is stopped; tenants' compiles take turns; the cache is bounded by bytes, the largest holder giving way."""
import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from slora.models.builtin import smollm2_folder
from slora.sampling.grammar import GrammarCompiler
from slora.sampling.grammar_service import (
    CompileLimits,
    GrammarLimitError,
    GrammarQueueFull,
    GrammarService,
    _GrammarCache,
    _Job,
    _TurnQueue,
)
from slora.sampling.structured_output import StructuredOutput

VOCAB = 49152
SCHEMA = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"]}))     # about 2 MiB compiled
REGEX = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")
BOMB = StructuredOutput("regex", "(a*)" * 400)             # minutes to compile, unbounded
RESULT_S = 60                                              # a loaded CI machine starts a worker in seconds


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="module")
def service(tokenizer):
    limits = CompileLimits(timeout_s=1.5, max_grammar_bytes=2 ** 20, workers=1, max_pending_per_tenant=2)
    svc = GrammarService.for_tokenizer(tokenizer, VOCAB, [tokenizer.eos_token_id], limits)
    yield svc
    svc.close()


def first_mask(compiler: GrammarCompiler, compiled) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    compiler.mask(logits, [compiler.start(compiled)])
    return torch.isfinite(logits[0])


def test_a_worker_compiles_the_same_grammar_as_in_process(service, tokenizer):
    compiled = service.submit("t1", REGEX).result(RESULT_S)
    assert compiled.spec == REGEX
    local = GrammarCompiler(tokenizer, VOCAB)
    allowed = first_mask(local, compiled)
    assert torch.equal(allowed, first_mask(local, local.compile(REGEX)))
    assert 0 < int(allowed.sum()) < VOCAB


def test_a_compile_bomb_stops_at_its_budget_and_the_next_compile_runs(service):
    began = time.monotonic()
    with pytest.raises(GrammarLimitError, match="did not compile within 1.5 s") as caught:
        service.submit("t1", BOMB).result(RESULT_S)
    assert caught.value.limit == "grammar_compile_timeout_s"
    assert time.monotonic() - began < RESULT_S / 2
    assert service.submit("t1", StructuredOutput("regex", "[0-9]+")).result(RESULT_S).spec.kind == "regex"


def test_a_grammar_over_the_size_budget_is_refused_by_its_size(service):
    with pytest.raises(GrammarLimitError, match="MiB, over the server's limit of 1 MiB") as caught:
        service.submit("t1", SCHEMA).result(RESULT_S)
    assert caught.value.limit == "grammar_max_bytes"


def test_an_invalid_spec_is_a_value_error_naming_it(service):
    with pytest.raises(ValueError, match="invalid regex"):
        service.submit("t1", StructuredOutput("regex", "(unclosed")).result(RESULT_S)


def test_an_abandoned_compile_is_stopped_and_frees_the_worker(tokenizer):
    patient = GrammarService.for_tokenizer(tokenizer, VOCAB, [tokenizer.eos_token_id],
                                           CompileLimits(timeout_s=300, workers=1))
    try:
        future = patient.submit("t2", BOMB)
        time.sleep(0.5)                       # running in the worker now
        patient.abandon(future)
        began = time.monotonic()
        compiled = patient.submit("t3", StructuredOutput("regex", "[a-z]+")).result(RESULT_S)
        assert compiled.spec.kind == "regex"
        # The bomb alone would hold the only worker for minutes; a new worker process starts in seconds.
        assert time.monotonic() - began < RESULT_S / 2, "the abandoned bomb kept the only worker"
    finally:
        patient.close()


def test_a_tenant_past_its_pending_bound_gets_queue_full(service):
    bombs = [service.submit("flood", StructuredOutput("regex", "(b*)" * (300 + i))) for i in range(2)]
    with pytest.raises(GrammarQueueFull, match="2 structured-output compiles of this tenant"):
        service.submit("flood", StructuredOutput("regex", "(c*)" * 300))
    for bomb in bombs:
        service.abandon(bomb)


def test_tenants_take_turns_in_the_compile_queue():
    queue = _TurnQueue()
    jobs = [_Job(("flood", StructuredOutput("regex", str(i)))) for i in range(3)]
    calm = _Job(("calm", StructuredOutput("regex", "x")))
    for job in jobs + [calm]:
        queue.put(job)
    assert [queue.take() for _ in range(4)] == [jobs[0], calm, jobs[1], jobs[2]]
    queue.put(late := _Job(("calm", StructuredOutput("regex", "y"))))
    assert queue.remove(late) and not queue.remove(late)
    queue.close()
    assert queue.take() is None


def test_the_cache_is_bounded_by_bytes_and_the_largest_holder_gives_way():
    cache = _GrammarCache(capacity=100)
    cache.put(("a", StructuredOutput("regex", "1")), "a1", 40)
    cache.put(("a", StructuredOutput("regex", "2")), "a2", 40)
    cache.put(("b", StructuredOutput("regex", "1")), "b1", 30)      # 110 > 100: a holds most, its oldest goes
    assert cache.get(("a", StructuredOutput("regex", "1"))) is None
    assert cache.get(("a", StructuredOutput("regex", "2"))) == "a2"
    assert cache.get(("b", StructuredOutput("regex", "1"))) == "b1"
    assert cache.bytes == 70
    cache.put(("c", StructuredOutput("regex", "1")), "c1", 101)     # larger than the whole cache: not kept
    assert cache.get(("c", StructuredOutput("regex", "1"))) is None and cache.bytes == 70


def test_one_tenants_compile_never_serves_another(service):
    spec = StructuredOutput("regex", "[x-z]{2}")
    first = service.submit("t4", spec).result(RESULT_S)
    assert service.submit("t4", spec).result(RESULT_S).grammar is first.grammar       # the tenant's cache hit
    assert service.submit("t5", spec).result(RESULT_S).grammar is not first.grammar
