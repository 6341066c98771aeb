"""The engine: requests in, one scheduled forward per step, outputs out (DESIGN §3)."""
import dataclasses
import hashlib
import hmac
import itertools
import logging
import os
import random
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from slora.config import EngineConfig
from slora.core.fair_share import TenantShare
from slora.core.outputs import (
    ADAPTER_UNAVAILABLE,
    INTERNAL_ERROR,
    EngineSnapshot,
    RequestError,
    RequestOutput,
    TokenLogprob,
)
from slora.core.scheduler import ScheduledSeq
from slora.core.sequence import AdapterRef, Sequence, SequenceStatus
from slora.core.step_stats import StepStats, StepTimer
from slora.execution.adapter_manager import UnknownAdapterError, sequence_adapters
from slora.execution.device_copy import select_rows, tensor_on
from slora.execution.in_flight import ArrivingSample, Launched, ReadySample, TokensInFlight
from slora.execution.parallel_runner import ParallelRunner
from slora.execution.tensor_parallel import TensorParallelError
from slora.kv_scales import kv_cache_scales
from slora.models.builtin import ModelSource, resolve_model
from slora.models.config import ModelConfig
from slora.models.loader import load_model
from slora.models.sharding import Shard
from slora.models.tokenizer import eos_token_ids, load_tokenizer
from slora.pool_parts import build_pool_parts
from slora.sampling.beam_search import BeamGroup, BeamSettings, Proposal, propose
from slora.sampling.engine_grammars import EngineGrammars
from slora.sampling.params import SamplingParams
from slora.sampling.request_state import (
    RequestState,
    SequenceMaker,
    check_request,
    record_prompt_logprobs,
    step_grammars,
)
from slora.sampling.sampler import Sampler
from slora.sampling.stopping import append_token
from slora.sizing import EngineSizing
from slora.workers import Workers

if TYPE_CHECKING:
    from slora.sampling.grammar import CompiledGrammar

__all__ = ["Engine", "UnknownAdapterError"]

logger = logging.getLogger(__name__)
# Longest a step that schedules nothing waits for an adapter's read from disk to end: the longest a request
# arriving meanwhile waits for the server's loop to take it.
IDLE_STEP_WAIT_S = 0.005


class BeamRow(NamedTuple):
    """A completing beam: its logits row in the step, its sequence, its request and the request's group."""
    row: int
    seq: Sequence
    state: RequestState
    group: BeamGroup


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model)
        # Under tensor parallelism this engine is rank 0, and holds its part of the model (slora.workers).
        self._workers = Workers(config) if config.tensor_parallel_size > 1 else None
        shard = None if self._workers is None else Shard(0, config.tensor_parallel_size)
        try:
            self._build_parts(source, shard)
        except BaseException:
            if self._workers is not None:          # they wait on this rank: they would wait for ever
                self._workers.stop(timeout_s=0)
            raise
        if self.runner.shape.quantized:
            self.runner.set_kv_scales(kv_cache_scales(config.kv_cache_scales, source.folder, self.model,
                                                      self.runner.shape, config.torch_device, self.tokenizer,
                                                      self.model_config.vocab_size, shard or Shard(0, 1)))
        self.sampler = Sampler(self.eos_token_ids)
        if config.device != "cpu":
            self.sampler.warm_up(self.model_config.vocab_size, config.torch_device)
        self.grammars = EngineGrammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                       config.grammar_token_budget_ms / 1e3, config.grammar_slow_tokens)
        self.step_stats = StepStats()          # wall time of steps by kind (prefill, decode, mixed)
        self._decode_bytes = self.sizing.decode_bytes(self.adapters.weight_bytes)
        self._salt_secret = os.urandom(32)
        self.num_prompt_tokens_computed = 0   # prompt tokens that went through a forward (cache misses)
        self._seed_source = random.Random(config.seed)   # seeds of requests that give none
        # Requests that failed (_fail_request) or ended their beam search since the last step returned.
        self._ended: list[str] = []
        self._tokens = TokensInFlight(pin=config.device != "cpu")
        self.requests: dict[str, RequestState] = {}
        self._seqs = SequenceMaker(self.scheduler, self.tokenizer)
        self.adapters.load_demos(source.demo_adapters)

    def _build_parts(self, source: ModelSource, shard: Shard | None) -> None:
        """The model (this rank's part of it), its tokenizer and sizing, and the pool's owners."""
        config = self.config
        self.model = load_model(source.folder, config.torch_dtype, config.torch_device, config.load_format, shard)
        if self._workers is not None:
            self.model.tensor_parallel = self._workers.group.tp
        self.model_config: ModelConfig = self.model.config
        self.model_name = source.served_name
        self.tokenizer = load_tokenizer(source.folder)
        self.sizing = EngineSizing.of(config, self.model, source.folder)
        self.max_model_len = self.sizing.max_model_len
        self.shapes = self.sizing.shapes            # the whole model's adapter layout: adapters are checked on it
        self.eos_token_ids = eos_token_ids(self.model_config.eos_token_ids, self.tokenizer)
        # The pool's pages, shared by KV (the scheduler's) and adapter weights (the manager's).
        self.runner, self.allocator, self.adapters, self.scheduler = build_pool_parts(
            self.sizing, None if self._workers is None else self._workers.others)

    # ---- adapters -----------------------------------------------------------------------------------
    def _refresh_host_tier(self) -> None:
        """Adapter reads from disk: finish those done, and start those the head of the queue needs (only
        requests that could be admitted within a step or two: reading back the adapters of a whole long
        queue would crowd the host cache with adapters needed much later)."""
        head = itertools.islice(self.scheduler.waiting, self.config.max_num_seqs)
        for version, reason in self.adapters.refresh(head):
            self._fail_version(version, reason)

    def _fail_version(self, version: str, reason: str) -> None:
        """Fail the requests waiting for a version that cannot be read back (running ones have it in the pool)."""
        logger.error("adapter version %s is unavailable: %s; its waiting requests fail", version[:12], reason)
        error = RequestError(ADAPTER_UNAVAILABLE, f"the adapter is unavailable: {reason}; load it again")
        waiting = [s.request_id for s in self.scheduler.waiting if s.adapter and s.adapter.version == version]
        for request_id in dict.fromkeys(waiting):
            self._fail_request(request_id, error)

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, owner: str | None = None, stream: bool = True,
                    grammar: "CompiledGrammar | None" = None, priority: int = 0) -> None:
        """Queue a request. Raises ValueError (UnknownAdapterError for a bad adapter) on bad input.
        `owner`: the tenant, whose adapter namespace, prefix cache and fair share the request uses.
        stream=False: the caller reads only the final output, so `step` returns the request only when it
        ends, and unless a stop string needs it the text is decoded then, not token by token. `grammar`:
        `params.structured` compiled already (a server compiles off this thread); without it, compiled here.
        `priority`: lower is admitted first among the owner's requests (not under the fcfs policy)."""
        ref, settings = self._admit(request_id, prompt_token_ids, params, adapter, owner, priority)
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seed_source.randrange(2 ** 62))
        grammars = None if params.structured is None else [self.grammars.start(params.structured, grammar)]
        if ref is not None:
            self.adapters.acquire(ref.version)
        parent = self._seqs.new(request_id, prompt_token_ids, params, ref, self.cache_salt(owner), tenant=owner,
                                priority=priority)
        beams = None if settings is None else BeamGroup.start(settings, parent)
        self.requests[request_id] = RequestState(
            request_id, list(prompt_token_ids), [parent], None if ref is None else ref.version, [""],
            1 if beams else params.num_samples, [self._seqs.detokenizer()], stream and beams is None,
            grammars=grammars, beams=beams, decode=self._seqs.decode)
        self.scheduler.add(parent)

    def _admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
               owner: str | None, priority: int) -> tuple[AdapterRef | None, BeamSettings | None]:
        """Every check that can refuse a request, before anything changes: the adapter it resolves to, and its
        beam search's settings if it is one."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len,
                      self.config.max_num_seqs, self.config.max_beam_width)
        ref = None if adapter is None else self.adapters.resolve(adapter, owner)
        self.scheduler.check_fits(len(prompt_token_ids), ref)
        self.scheduler.check_priority(priority)
        if not params.use_beam_search:
            return ref, None
        settings = self._beam_settings(params, len(prompt_token_ids))
        self.scheduler.check_beams_fit(len(prompt_token_ids), settings.width, settings.max_tokens, ref)
        return ref, settings

    def _beam_settings(self, params: SamplingParams, prompt_len: int) -> BeamSettings:
        """A beam search's settings: it ends at max_tokens or the model's context, whichever comes first."""
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        width = params.beam_search_width
        assert width is not None, "a beam search's params"
        return BeamSettings(width=width, length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                            max_tokens=min(params.max_tokens, self.max_model_len - prompt_len),
                            stop_token_ids=stops, num_logprobs=params.logprobs)

    def cache_salt(self, owner: str | None) -> bytes:
        """Per-tenant salt of the prefix-cache hashes: one tenant's cached pages never serve another. It covers the
        cache dtype too: pages are shared only between caches that hold K and V alike."""
        key = f"{self.runner.shape.cache_dtype}\0{owner or ''}".encode()
        return hmac.new(self._salt_secret, key, hashlib.sha256).digest()

    @property
    def scheduling_policy(self) -> str:
        return self.config.scheduling_policy or "fcfs"

    def tenant_shares(self) -> dict[str | None, TenantShare]:
        """Each tenant's service so far; cheap (one entry per tenant), unlike `snapshot()`, which walks the queue."""
        return self.scheduler.shares()

    def set_tenant_weight(self, owner: str | None, weight: float) -> None:
        """The owner's share of the engine under the vtc policy: weight 2 gets twice a weight-1 tenant's service
        while both wait. ValueError unless positive."""
        self.scheduler.set_weight(owner, weight)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is not running."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
        return self._finalize(state)

    def check_alive(self) -> None:
        """TensorParallelError naming a tensor-parallel rank whose process has ended (an engine of one: nothing)."""
        if self._workers is not None:
            self._workers.check_alive()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for an engine of one). Idempotent."""
        workers, self._workers = self._workers, None
        if workers is None:
            return
        assert isinstance(self.runner, ParallelRunner), "an engine with workers runs them"
        try:
            self.runner.stop()
        except TensorParallelError as exc:       # a rank already gone: the others are stopped below
            logger.warning("stopping the tensor-parallel ranks: %s", exc)
        workers.stop()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, launch one forward, collect the step before's tokens, sample; outputs of the requests
        that changed, of those added with stream=False only once they end (building them every step cost a
        tenth of its host work). Under async_scheduling a step's tokens reach the host in the next step,
        while that one's forward runs: its decode rows read them on the device."""
        self._refresh_host_tier()
        out = self.scheduler.schedule()
        touched = self._reject(out.rejected)
        if self._restart_beams(out.preempted):
            out.scheduled = [item for item in out.scheduled if item.seq.status is not SequenceStatus.FINISHED]
        self.runner.move_pages(out, self.adapters.packed(v for v, _ in out.adapters_to_load))
        launched = self._launch(out.scheduled) if out.scheduled else None
        self._collect(touched)                        # the step before's, while this forward runs
        if launched is not None:
            self._sample_step(launched)
            if not self.config.async_scheduling:
                self._collect(touched)
        touched.update(self._take_ended())
        outputs = [self._finalize(state) for state in touched.values() if state.stream or state.finished]
        if not self.requests:
            self._collect(touched)           # rows of ended sequences only: its time is not left to the next
        if not out.scheduled and not outputs:
            # Nothing ran: where requests wait for adapter reads from disk, a caller's loop of steps would spin.
            self.adapters.wait_for_reads(IDLE_STEP_WAIT_S)
        return outputs

    def _reject(self, rejected: list[Sequence]) -> dict[str, RequestState]:
        """End the sequences the scheduler can never fit; their requests are touched."""
        for seq in rejected:
            self.scheduler.finish(seq, "length")
        return {seq.request_id: self.requests[seq.request_id] for seq in rejected}

    def _launch(self, scheduled: list[ScheduledSeq]) -> Launched:
        """The step's forward, queued on the device: its logits `[rows, vocab]` are not read yet."""
        versions = {i.seq.adapter.version for i in scheduled if i.seq.adapter}
        timer = StepTimer(self.step_stats, scheduled, versions, self._decode_bytes)
        logits = self.runner.run(scheduled, self.adapters.step_adapters(versions), self._tokens.on_device())
        # Now: a sequence that ends before the sampling (a failed request's) no longer counts as completing.
        return Launched(scheduled, [item.seq for item in scheduled if item.completes], logits, timer)

    def _sample_step(self, launched: Launched) -> None:
        """After the step before's tokens are appended: the prompt logprobs, the computed tokens, and the
        samples of the completing sequences (logits row i: completing[i]), left on their way to the host. A
        sequence that ended meanwhile is not sampled, and its freed pages are not registered."""
        scheduled, completing, logits, timer = launched
        record_prompt_logprobs(self.requests, scheduled, logits[len(completing):],
                               lambda seq: self._fail_internal(seq, "computing its prompt logprobs"))
        for item in scheduled:
            if item.seq.status is not SequenceStatus.FINISHED:
                self.num_prompt_tokens_computed += item.prompt_tokens
                self.scheduler.on_computed(item.seq, item.num_tokens)
        rows, seqs, beam_rows = self._sampling_rows(completing)
        self._tokens.send(seqs, *self._sample(select_rows(logits, rows), seqs), timer)
        if beam_rows:
            self._advance_beams(logits, beam_rows)

    def _collect(self, touched: dict[str, RequestState]) -> None:
        """Append the tokens of the step in flight, once they are on the host."""
        self._append_tokens(self._tokens.take(), touched)

    def _sample(self, logits: Tensor, seqs: list[Sequence]) -> tuple[Tensor, ArrivingSample]:
        """A token for each sequence (row of `logits`), sampled as one batch: the ids `[rows]` on the device,
        and their copy coming to the host. Should the batch raise, the rows are sampled one by one, so that
        only the requests whose own rows raise fail."""
        grammars = step_grammars(self.requests, seqs)
        masker = None if grammars is None else self.grammars
        try:
            sample = self.sampler.on_device(logits, seqs, grammars, masker)
            if grammars is not None:
                for request_id, error in self.grammars.slow_failures([s.request_id for s in seqs], grammars):
                    self._fail_request(request_id, error)
            return sample.token_ids, self._tokens.copy_to_host(sample)
        except Exception:
            logger.warning("sampling a batch of %d rows failed; sampling them one by one", len(seqs),
                           exc_info=True)
        result = self.sampler.one_by_one(logits, seqs, grammars, masker,
                                         lambda seq: self._fail_internal(seq, "sampling its next token"))
        return tensor_on(result.token_ids, torch.int64, logits.device), ReadySample(result)

    def _fail_internal(self, seq: Sequence, stage: str) -> None:
        """From an `except` around one request's work (a plain try/except: it runs per token): that request
        alone fails, the log gets the traceback, the client an internal_error naming the stage."""
        logger.exception("request %s failed while %s; the other requests go on", seq.request_id, stage)
        self._fail_request(seq.request_id, RequestError(INTERNAL_ERROR, f"internal error while {stage}; "
                                                        "the request was stopped"))

    def _fail_request(self, request_id: str, error: RequestError) -> None:
        """The one way a request fails alone: its unfinished samples end with "error" and free their pages,
        and the step returns its output with `error` (the first one, if it fails twice)."""
        state = self.requests.get(request_id)
        if state is None or state.error is not None:
            return
        state.error = error
        for seq in state.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "error")
        self._ended.append(request_id)

    def _take_ended(self) -> dict[str, RequestState]:
        """The requests failed or ended by their beam search since the last step returned, except those aborted
        meanwhile."""
        if not self._ended:                           # the common step: nothing to build
            return {}
        ended, self._ended = self._ended, []
        return {request_id: self.requests[request_id] for request_id in ended if request_id in self.requests}

    def _sampling_rows(self, completing: list[Sequence]) -> tuple[list[int], list[Sequence], list[BeamRow]]:
        """The logits row of each sequence that samples now (forked samples share their parent's row), and of
        each beam, whose group selects its next token instead (_advance_beams)."""
        rows, seqs, beam_rows = [], [], []
        for row, seq in enumerate(completing):
            if seq.status is SequenceStatus.FINISHED:
                continue                               # its pending token ended it
            state = self.requests[seq.request_id]
            if state.beams is not None:
                beam_rows.append(BeamRow(row, seq, state, state.beams))
                continue
            family = [seq] + (self._seqs.fork_samples(state) if state.needs_fork and seq is state.seqs[0] else [])
            rows += [row] * len(family)
            seqs += family
        return rows, seqs, beam_rows

    # ---- beam search --------------------------------------------------------------------------------
    def _advance_beams(self, logits: Tensor, beam_rows: list[BeamRow]) -> None:
        """The completing beams' rows of `logits` propose their best tokens; each group whose proposals are all
        in selects its next beams. A group that raises fails alone."""
        sizes = [b.group.settings.proposals_per_beam for b in beam_rows]
        proposals = propose(select_rows(logits, [b.row for b in beam_rows]), sizes)
        for beam_row, proposal in zip(beam_rows, proposals, strict=True):
            try:
                self._offer_beam(beam_row, proposal)
            except Exception:
                self._fail_internal(beam_row.seq, "selecting its beams")

    def _offer_beam(self, beam_row: BeamRow, proposal: Proposal) -> None:
        _, seq, state, group = beam_row
        if state.error is not None or not group.offer(seq, proposal):
            return
        group.advance(self._seqs.fork, lambda beam: self.scheduler.finish(beam, "stop"))
        if group.done:
            self._ended.append(state.request_id)
        else:
            state.seqs = [beam.seq for beam in group.beams]

    def _restart_beams(self, preempted: list[Sequence]) -> bool:
        """A beam preempted takes its group back to the start: its beams end (those scheduled in this step
        leave it) and one sequence of the prompt takes the group's place in the queue. Beam search is
        deterministic, so it finds the same beams again, sharing pages as it forks, where recomputing or
        swapping each beam apart would give each its own copy of the shared history. Whether any did."""
        restarted = False
        for seq in preempted:
            state = self.requests.get(seq.request_id)
            if state is None or state.beams is None or seq.status is SequenceStatus.FINISHED:
                continue
            for beam in state.seqs:
                self.scheduler.finish(beam, "preempted")
            parent = self._seqs.copy(seq)
            state.beams = BeamGroup.start(state.beams.settings, parent)
            state.seqs = [parent]
            self.scheduler.restart(parent, seq.arrival)
            restarted = True
        return restarted

    def _append_tokens(self, sampled: Iterable[tuple[Sequence, int, TokenLogprob | None]],
                       touched: dict[str, RequestState]) -> None:
        for seq, token, logprob in sampled:
            if seq.status is SequenceStatus.FINISHED:
                continue                               # another sample's fault failed its request
            state = touched[seq.request_id] = self.requests[seq.request_id]
            try:
                reason = append_token(state, seq, token, logprob, self.eos_token_ids, self.max_model_len)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
            except Exception:
                self._fail_internal(seq, "handling its new token")

    def _finalize(self, state: RequestState) -> RequestOutput:
        output = state.output()
        if state.finished:
            del self.requests[state.request_id]
            if state.adapter_version is not None:
                self.adapters.release(state.adapter_version)
        return output

    # ---- introspection ------------------------------------------------------------------------------
    def pool_stats(self) -> dict[str, int]:
        return self.allocator.stats().as_dict()

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters now. Besides O(1) counts, one pass over the waiting sequences (their adapters),
        and, for the adapters in the pool, in host memory or in use, one over the registered names."""
        scheduler, adapters, stats, pool = self.scheduler, self.adapters.counts(), self.step_stats, self.pool_stats()
        running, waiting = sequence_adapters(scheduler.running), sequence_adapters(scheduler.waiting)
        return EngineSnapshot(pool=pool, sequences_running=len(scheduler.running),
                              sequences_waiting=len(scheduler.waiting), requests=len(self.requests),
                              preemptions=scheduler.num_preemptions, adapter_pool_loads=adapters.pool_loads,
                              adapter_pool_evictions=adapters.pool_evictions, adapters_registered=adapters.names,
                              adapters_host=adapters.on_host, adapters_pool=adapters.in_pool,
                              steps=dict(stats.steps), step_seconds=dict(stats.seconds),
                              decode_bytes=stats.decode_bytes, tenants=self.tenant_shares(), taken_at=time.time(),
                              adapter_placements=self.adapters.placements(v for _, v in running | waiting),
                              running_adapters=running, waiting_adapters=waiting,
                              adapter_slots=self.config.max_loras or self.config.max_num_seqs,
                              pinned_adapter_pages=pool["adapter_pages"] - self.adapters.idle_pages(),
                              adapter_load_seconds=self.adapters.load_times.counted())

    def check(self) -> None:
        """Assert the pool's invariants (tests call it after every scenario)."""
        self.scheduler.check()
