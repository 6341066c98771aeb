"""The engine: requests in, one scheduled forward per step, outputs out (DESIGN §3)."""
import dataclasses
import hashlib
import hmac
import itertools
import logging
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from slora.adapter_store import AdapterStore, PreparedAdapter, StoredAdapter, folder_bytes
from slora.adapters.errors import AdapterError
from slora.adapters.packing import pack_adapter
from slora.adapters.registry import AdapterEntry, AdapterRegistry
from slora.adapters.shapes import TargetShapes
from slora.adapters.weights import load_adapter
from slora.builtin_models import resolve_model
from slora.config import EngineConfig
from slora.detokenizer import IncrementalDetokenizer
from slora.cuda_graphs import GraphLimits
from slora.kernels.checks import check_adapter_span
from slora.kernels.layout import align_up
from slora.model_runner import ModelRunner, PoolShape, StepAdapters, profile_activation_bytes
from slora.models.config import ModelConfig
from slora.models.loader import load_model
from slora.outputs import ADAPTER_UNAVAILABLE, INTERNAL_ERROR, CompletionOutput, RequestError, RequestOutput
from slora.page_pool import PageAllocator
from slora.sampler import Sampler
from slora.sampling_params import SamplingParams
from slora.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from slora.sequence import AdapterRef, Sequence, SequenceStatus
from slora.step_stats import DecodeBytes, StepStats, StepTimer
from slora.stopping import check_stop
from slora.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class UnknownAdapterError(ValueError):
    """The request names an adapter that does not exist or that the caller may not use."""


def _remove_folder(folder: Path | None) -> None:
    """Delete an adapter folder the engine owns; one already gone is fine."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("adapter folder %s deleted", folder)


@contextmanager
def _removed_if_refused(folder: Path | None, owns_files: bool) -> Iterator[None]:
    """An owned folder whose adapter is refused is deleted: nothing would ever read it again."""
    try:
        yield
    except Exception:
        if owns_files:
            _remove_folder(folder)
        raise


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    adapter_version: str | None
    texts: list[str] = field(default_factory=list)
    num_samples: int = 1              # samples 1.. are forked from sample 0 after its prefill
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    stream: bool = True               # the caller reads outputs while it runs (False: only the final one)
    error: RequestError | None = None  # why the engine failed it (its unfinished samples end with "error")

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        samples = [CompletionOutput(s.sample_index, list(s.output_token_ids), self.texts[i], s.finish_reason)
                   for i, s in enumerate(self.seqs)]
        return RequestOutput(self.request_id, self.prompt_token_ids, samples, self.finished,
                             self.seqs[0].num_cached_tokens, self.error)

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.num_samples


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model)
        folder = source.folder
        self.model = load_model(folder, config.torch_dtype, config.torch_device, config.load_format)
        self.model_config: ModelConfig = self.model.config
        self.model_name = source.served_name
        self.tokenizer = load_tokenizer(folder)
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len,
                                 self.model_config.max_model_len)
        self.eos_token_ids = self._eos_token_ids()
        self.shapes = TargetShapes(self.model_config.num_layers, self.model_config.hidden_size,
                                   self.model_config.q_size, self.model_config.kv_size,
                                   self.model_config.intermediate_size)
        template = PoolShape(self.model_config.num_layers, 0, config.page_size,
                             self.model_config.num_kv_heads, self.model_config.head_dim)
        self._check_adapter_size(template)
        pool_shape = dataclasses.replace(template, num_pages=self._num_pages(template))
        swap_pages = int(config.swap_space_gib * 2 ** 30) // self._page_bytes() if config.preemption_mode == "swap" else 0
        self.runner = ModelRunner(self.model, pool_shape, config.torch_dtype, config.torch_device,
                                  self._graph_limits(pool_shape), swap_pages, config.pdl)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.page_size, config.watermark,
                                                   config.enable_prefix_caching, config.preemption_mode,
                                                   swap_pages, max_loras=config.max_loras),
                                   PageAllocator(pool_shape.num_pages, config.page_size))
        self.sampler = Sampler()
        self.step_stats = StepStats()          # wall time of steps by kind (prefill, decode, mixed)
        self._decode_bytes = self._decode_byte_model()
        self._salt_secret = os.urandom(32)
        self.num_prompt_tokens_computed = 0   # prompt tokens that went through a forward (cache misses)
        self._seed_source = random.Random(config.seed)   # seeds of requests that give none
        self.registry = AdapterRegistry()
        self.store = AdapterStore(config.adapter_host_cache_bytes)
        self.scheduler.adapter_ready = self.adapter_ready
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slora-adapter-reader")
        self._failed: list[str] = []          # requests failed (_fail_request) since the last step returned
        self._reloading: dict[str, StoredAdapter] = {}   # versions being read back from disk
        self.requests: dict[str, RequestState] = {}
        self._next_seq_id = 0
        self._load_demo_adapters(source.demo_adapters)

    def _load_demo_adapters(self, adapters: dict[str, Path]) -> None:
        """The builtin model's demo adapters, except those the configuration cannot take."""
        for name, path in adapters.items():
            try:
                self.load_adapter(name, path, public=True)
            except AdapterError as exc:
                logger.warning("demo adapter %s not loaded: %s", name, exc)

    # ---- sizing -------------------------------------------------------------------------------------
    def _decode_byte_model(self) -> DecodeBytes:
        """What a decode step reads. A decode step reads only the batch's rows of the input embedding table,
        unless the table is tied to lm_head, which reads all of it."""
        embedding = self.model.model.embed_tokens.weight                        # [vocab, hidden]
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = self.model.lm_head.weight is embedding
        untied_table = 0 if tied else embedding.numel() * embedding.element_size()
        return DecodeBytes(params - untied_table, 0 if tied else embedding.shape[1] * embedding.element_size(),
                           self._page_bytes() // self.config.page_size, self._adapter_weight_bytes)

    def _adapter_weight_bytes(self, version: str) -> int:
        """Bytes of an adapter version's A and B in the pool's dtype (padding not counted), counted once when
        the version was stored: decode steps ask for it every step."""
        return self.store.versions[version].weight_bytes

    def _page_bytes(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return cfg.num_layers * 2 * self.config.page_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_pages(self, template: PoolShape) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        if self.config.device == "cpu":
            return max(1, int(self.config.pool_gib * 2 ** 30) // self._page_bytes())
        # After the weights: a profiling prefill at the largest step measures the activations; the
        # rest of `gpu_memory_utilization` of the whole GPU becomes pages.
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        activations = profile_activation_bytes(self.model, template, tokens, self.config.torch_dtype,
                                               self.config.torch_device)
        free, total = torch.cuda.mem_get_info(self.config.torch_device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activations
        pages = int(budget) // self._page_bytes()
        if pages < 1:
            raise ValueError("no GPU memory is left for the pool: raise gpu_memory_utilization or use a "
                             "smaller model")
        logger.info("pool: %d pages of %d tokens (%.2f GiB); activations %.2f GiB", pages,
                    self.config.page_size, pages * self._page_bytes() / 2 ** 30, activations / 2 ** 30)
        return pages

    def _max_adapter_pages(self, shape: PoolShape) -> int:
        """Pool pages of the largest adapter this engine takes (max_lora_rank on every module)."""
        rank = self.config.max_lora_rank
        elems = sum(rank * (align_up(i) + align_up(o)) for i, o in map(self.shapes.features, self.shapes.modules))
        return -(-elems // shape.page_elems)

    def _check_adapter_size(self, shape: PoolShape) -> None:
        """Refused at construction, rather than by the LoRA kernels at the first step with adapters."""
        check_adapter_span(self._max_adapter_pages(shape), shape.page_elems,
                           f"an adapter of max_lora_rank={self.config.max_lora_rank} (lower it)")

    def _graph_limits(self, shape: PoolShape) -> GraphLimits | None:
        if self.config.device == "cpu" or self.config.enforce_eager:
            return None
        return self.graph_limits(shape)

    def graph_limits(self, shape: PoolShape) -> GraphLimits:
        """The decode-graph and warm-up limits of a CUDA engine with this config over this pool shape."""
        rank = self.config.max_lora_rank
        return GraphLimits(max_batch=self.config.max_num_seqs,
                           max_blocks=-(-self.max_model_len // self.config.page_size),
                           max_adapter_pages=self._max_adapter_pages(shape), max_lora_rank=rank,
                           num_layers=self.model_config.num_layers, max_loras=self.config.max_loras,
                           few_adapters=self.config.graph_few_adapters, lora_fused=self.config.lora_fused,
                           lora_side_stream=self.config.lora_side_stream)

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- adapters -----------------------------------------------------------------------------------
    def prepare_adapter(self, path: str | Path) -> PreparedAdapter:
        """Read, validate, hash and pack a PEFT folder. Reads only immutable engine settings, so it may
        run on any thread. Raises AdapterError naming the field, or the file that could not be read."""
        try:
            return self._prepare(Path(path))
        except OSError as exc:                # e.g. a file removed or unreadable while it was read
            raise AdapterError(f"the adapter files could not be read: {exc.strerror or exc}") from None

    def _prepare(self, path: Path) -> PreparedAdapter:
        loaded = load_adapter(path, self.shapes, self.config.max_lora_rank)
        packed = pack_adapter(loaded, self.shapes, self.runner.shape.page_elems, self.config.torch_dtype)
        if self.config.device != "cpu":       # pinned, so copies into the pool run asynchronously
            packed = dataclasses.replace(packed, pages=packed.pages.pin_memory())
        return PreparedAdapter(loaded, packed, path, folder_bytes(path))

    def register_adapter(self, name: str, prepared: PreparedAdapter, owner: str | None = None,
                         public: bool = False, owns_files: bool = False) -> AdapterEntry:
        """Make a prepared adapter known under `name` (engine thread). Requests that resolved a version
        this name pointed at before keep it until they finish. owns_files: its folder (prepared.path) is the
        engine's from this call on, deleted once the version is dropped (no name points at it and no
        request uses it), or at once if the adapter is refused."""
        with _removed_if_refused(prepared.path, owns_files):
            self._check_registrable(name, prepared)
        stored = self.store.add(prepared)
        self._take_folder(stored, prepared.path, owns_files, owner)
        entry = AdapterEntry(name, prepared.version, owner, public)
        replaced = self.registry.register(entry)
        if replaced is not None:
            self._drop_if_unused(replaced.version)
        self.store.trim(set(self.scheduler.adapters.resident))
        logger.info("adapter %s loaded as version %s (%d pages)", name, prepared.version[:12],
                    prepared.packed.num_pages)
        return entry

    def load_adapter(self, name: str, path: str | Path, owner: str | None = None,
                     public: bool = False, owns_files: bool = False) -> AdapterEntry:
        """Validate and pack a PEFT folder and register it under `name`. Raises AdapterError.
        owns_files: as in register_adapter."""
        with _removed_if_refused(Path(path), owns_files):
            prepared = self.prepare_adapter(path)
        return self.register_adapter(name, prepared, owner, public, owns_files)

    def _check_registrable(self, name: str, prepared: PreparedAdapter) -> None:
        if not name or not isinstance(name, str):
            raise AdapterError("adapter name must be a non-empty string")
        usable = self.scheduler.usable_pages
        if prepared.packed.num_pages >= usable:
            raise AdapterError(f"adapter needs {prepared.packed.num_pages} pages but the pool has only "
                               f"{usable} usable")

    def _take_folder(self, stored: StoredAdapter, folder: Path | None, owns_files: bool,
                     namespace: str | None) -> None:
        """Take over an owned folder, the upload of `namespace`. A version is read back from the folder it was
        first stored from, so another folder of the same content (the same upload made twice) is never read:
        it goes at once."""
        if not owns_files or folder is None:
            return
        if stored.path is not None and stored.path.resolve() == folder.resolve():
            stored.owns_files, stored.files_namespace = True, namespace
        else:
            _remove_folder(folder)

    def adapter_disk_bytes(self, namespace: str | None) -> int:
        """Bytes on disk of the adapter folders behind the names in `namespace`, and of its uploads whose
        folders are still on disk (a replaced or unloaded upload stays until its last request ends), each
        version counted once."""
        named = {entry.version for (owner, _), entry in self.registry.entries.items() if owner == namespace}
        uploaded = {version for version, stored in self.store.versions.items()
                    if stored.owns_files and stored.files_namespace == namespace}
        return sum(self.store.versions[version].disk_bytes for version in named | uploaded)

    # ---- the host tier ------------------------------------------------------------------------------
    def adapter_ready(self, version: str) -> bool:
        """Whether the version can be scheduled now: in the pool, or packed in host memory."""
        return self.scheduler.adapters.is_resident(version) or self.store.versions[version].packed is not None

    def _refresh_host_tier(self) -> None:
        """Finish background reads from disk and start those the waiting requests need."""
        for version, stored in list(self._reloading.items()):
            if stored.reload.done():
                del self._reloading[version]
                self._finish_reload(stored)
        # Only the requests that could be admitted within a step or two: reading back the adapters of the
        # whole queue would cost a scan per step, and a long queue's reads would crowd the host cache
        # with adapters needed much later.
        for seq in itertools.islice(self.scheduler.waiting, self.scheduler.config.max_num_seqs):
            if seq.adapter is not None and not self.adapter_ready(seq.adapter.version):
                self._start_reload(self.store.versions[seq.adapter.version])

    def _start_reload(self, stored: StoredAdapter) -> None:
        if stored.reload is None:
            logger.info("reading adapter %s back from disk", stored.version[:12])
            stored.reload = self._loader.submit(self.prepare_adapter, stored.path)
            self._reloading[stored.version] = stored

    def _finish_reload(self, stored: StoredAdapter) -> None:
        future, stored.reload = stored.reload, None
        if self.store.versions.get(stored.version) is not stored:
            return      # dropped while it was read (its requests were aborted): kept, it would never leave
        prepared = self._reloaded(stored.version, future)
        if prepared is not None:
            self.store.add(prepared)
            self.store.num_reloads += 1
            self.store.trim(set(self.scheduler.adapters.resident))

    def _reloaded(self, version: str, future: Future) -> PreparedAdapter | None:
        """The version read back from disk; None if it could not be (its waiting requests are failed). Any
        exception counts: the files are the tenant's, and whatever they hold must not stop the engine."""
        try:
            prepared = future.result()
        except AdapterError as exc:
            self._fail_version(version, f"its files on disk are no longer valid: {exc}")
            return None
        except Exception:
            logger.exception("adapter version %s could not be read back from disk", version[:12])
            self._fail_version(version, "its files on disk could not be read")
            return None
        if prepared.version != version:
            self._fail_version(version, "its files changed on disk since it was loaded")
            return None
        return prepared

    def _fail_version(self, version: str, reason: str) -> None:
        """Fail the requests waiting for a version that cannot be read back (running ones have it in the pool)."""
        logger.error("adapter version %s is unavailable: %s; its waiting requests fail", version[:12], reason)
        error = RequestError(ADAPTER_UNAVAILABLE, f"the adapter is unavailable: {reason}; load it again")
        waiting = [s.request_id for s in self.scheduler.waiting if s.adapter and s.adapter.version == version]
        for request_id in dict.fromkeys(waiting):
            self._fail_request(request_id, error)

    def unload_adapter(self, name: str, owner: str | None = None) -> None:
        """Forget the name; running requests on it finish, then its pages are freed."""
        entry = self.registry.unregister(name, owner)
        if entry is None:
            raise UnknownAdapterError(f"adapter {name!r} does not exist")
        self._drop_if_unused(entry.version)

    def _drop_if_unused(self, version: str) -> None:
        """A version no name and no request uses leaves the host cache and, once idle, the pool; the folder
        the engine owns goes with it, unless another stored version is read back from the same folder."""
        dropped = self.store.forget_if_unused(version, self.registry.is_named(version))
        if dropped is None:
            return
        self.scheduler.adapters.retire(version)
        if dropped.owns_files and all(s.path != dropped.path for s in self.store.versions.values()):
            _remove_folder(dropped.path)

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, owner: str | None = None, stream: bool = True) -> None:
        """Queue a request. Raises ValueError (UnknownAdapterError for a bad adapter) on bad input.
        stream=False: the caller reads only the final output, so `step` returns the request only when it
        ends, and unless a stop string needs it the text is decoded then, not token by token."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={self.config.max_num_seqs}")
        self._check_prompt(prompt_token_ids)
        version, ref = self._resolve_adapter(adapter, owner)
        self._check_fits(len(prompt_token_ids), ref)
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seed_source.randrange(2 ** 62))
        if version is not None:
            self.store.acquire(version)
        parent = self._new_seq(request_id, prompt_token_ids, params, ref, 0, self.cache_salt(owner))
        self.requests[request_id] = RequestState(request_id, list(prompt_token_ids), [parent], version, [""],
                                                 num_samples=params.n,
                                                 detokenizers=[IncrementalDetokenizer(self.tokenizer)],
                                                 stream=stream)
        self.scheduler.add(parent)

    def cache_salt(self, owner: str | None) -> bytes:
        """Per-tenant salt of the prefix-cache hashes: one tenant's cached pages never serve another."""
        return hmac.new(self._salt_secret, (owner or "").encode(), hashlib.sha256).digest()

    def _new_seq(self, request_id: str, prompt: list[int], params: SamplingParams, ref: AdapterRef | None,
                 index: int, salt: bytes) -> Sequence:
        self._next_seq_id += 1
        return Sequence(self._next_seq_id, request_id, list(prompt), params, ref, sample_index=index,
                        cache_salt=salt)

    def _fork_samples(self, state: RequestState) -> list[Sequence]:
        """After the first sample's prefill, the other samples start as copies sharing its pages."""
        parent = state.seqs[0]
        children = [self._new_seq(state.request_id, parent.prompt_token_ids, parent.params, parent.adapter, i,
                                  parent.cache_salt) for i in range(1, state.num_samples)]
        for child in children:
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.fork(parent, child)
            state.seqs.append(child)
            state.texts.append("")
            state.detokenizers.append(IncrementalDetokenizer(self.tokenizer))
        return children

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is "
                             f"{self.max_model_len} tokens, including at least one generated")

    def _resolve_adapter(self, name: str | None, owner: str | None) -> tuple[str | None, AdapterRef | None]:
        if name is None:
            return None, None
        entry = self.registry.resolve(name, owner)
        if entry is None:
            raise UnknownAdapterError(f"adapter {name!r} does not exist")
        return entry.version, AdapterRef(entry.version, self.store.versions[entry.version].num_pages)

    def _check_fits(self, prompt_len: int, ref: AdapterRef | None) -> None:
        pages = -(-(prompt_len + 1) // self.config.page_size) + (ref.num_pages if ref else 0)
        usable = self.scheduler.usable_pages
        if pages > usable:
            raise ValueError(f"the request needs {pages} pages but the pool has only {usable} usable")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; None if it is not running."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
        return self._finalize(state)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; outputs of the requests that changed, of those added with
        stream=False only once they end (building every running request's output each step was about a
        tenth of the host work per step at batch 64, for a caller that reads none of them)."""
        self._refresh_host_tier()
        out = self.scheduler.schedule()
        touched: dict[str, RequestState] = {}
        for seq in out.rejected:
            self.scheduler.finish(seq, "length")
            touched[seq.request_id] = self.requests[seq.request_id]
        self.runner.move_pages(out, {v: self.store.versions[v].packed for v, _ in out.adapters_to_load})
        if out.scheduled:
            self._run(out, touched)
        touched.update(self._take_failed())
        return [self._finalize(state) for state in touched.values() if state.stream or state.finished]

    def _run(self, out: SchedulerOutput, touched: dict[str, RequestState]) -> None:
        resident = self.scheduler.adapters.resident
        versions = {i.seq.adapter.version for i in out.scheduled if i.seq.adapter}
        adapters = {v: (self.store.versions[v].descriptor, resident[v].pages) for v in versions}
        with StepTimer(self.step_stats, out.scheduled, versions, self._decode_bytes):
            self._forward_and_sample(out, adapters, touched)

    def _forward_and_sample(self, out: SchedulerOutput, adapters: StepAdapters, touched: dict[str, RequestState]) -> None:
        logits = self.runner.run(out.scheduled, adapters)
        completing = [item.seq for item in out.scheduled if item.completes]
        for item in out.scheduled:
            prompt_len = len(item.seq.prompt_token_ids)
            self.num_prompt_tokens_computed += max(0, min(prompt_len, item.seq.num_computed_tokens + item.num_tokens)
                                                   - item.seq.num_computed_tokens)
            self.scheduler.on_computed(item.seq, item.num_tokens)
        rows, seqs = self._sampling_rows(completing)
        self._append_tokens(self._sample(logits[rows], seqs), touched)

    def _sample(self, logits: Tensor, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """A token for each sequence (row of `logits`), sampled as one batch. Should the batch raise, the
        rows are sampled one by one, so that only the requests whose own rows raise fail."""
        try:
            return list(zip(seqs, self.sampler(logits, seqs)))
        except Exception:
            logger.warning("sampling a batch of %d rows failed; sampling them one by one", len(seqs),
                           exc_info=True)
        sampled = []
        for row, seq in enumerate(seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue                               # another sample's fault failed its request
            try:
                sampled.append((seq, self.sampler(logits[row:row + 1], [seq])[0]))
            except Exception:
                self._fail_internal(seq, "sampling its next token")
        return sampled

    def _fail_internal(self, seq: Sequence, stage: str) -> None:
        """Called from an `except` around one request's work: that request alone fails. The log gets the
        traceback; the client an internal_error naming the stage, not the engine's internals. (A plain
        try/except at each call site, not a context manager: it runs per token on the decode path.)"""
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
        self._failed.append(request_id)

    def _take_failed(self) -> dict[str, RequestState]:
        """The requests failed since the last step returned, except those aborted meanwhile."""
        if not self._failed:                          # the common step: nothing to build
            return {}
        failed, self._failed = self._failed, []
        return {request_id: self.requests[request_id] for request_id in failed if request_id in self.requests}

    def _sampling_rows(self, completing: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """The logits row of each sequence that samples now; forked samples share their parent's row."""
        rows, seqs = [], []
        for row, seq in enumerate(completing):
            state = self.requests[seq.request_id]
            family = [seq] + (self._fork_samples(state) if state.needs_fork and seq is state.seqs[0] else [])
            rows += [row] * len(family)
            seqs += family
        return rows, seqs

    def _append_tokens(self, sampled: list[tuple[Sequence, int]], touched: dict[str, RequestState]) -> None:
        for seq, token in sampled:
            if seq.status is SequenceStatus.FINISHED:
                continue                               # another sample's fault failed its request
            try:
                self._append_token(seq, token)
            except Exception:
                self._fail_internal(seq, "handling its new token")
            touched[seq.request_id] = self.requests[seq.request_id]

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        state = self.requests[seq.request_id]
        index = seq.sample_index                     # its place in state.seqs
        detokenizer = state.detokenizers[index]
        previous_len = len(detokenizer.text)
        decode_now = state.stream or seq.params.stop     # stop strings are matched against the text as it grows
        text = detokenizer.add(token) if decode_now else detokenizer.hold(token)
        result = check_stop(seq, text, self.eos_token_ids, self.max_model_len, previous_len)
        state.texts[index] = result.text
        if result.reason is None:
            return
        if result.reason != "stop" or result.text == detokenizer.text:
            state.texts[index] = detokenizer.final_text()      # no stop string cut: the exact decode
        self.scheduler.finish(seq, result.reason)

    def _finalize(self, state: RequestState) -> RequestOutput:
        output = state.output()
        if state.finished:
            del self.requests[state.request_id]
            if state.adapter_version is not None:
                self.store.release(state.adapter_version)
                self._drop_if_unused(state.adapter_version)
        return output

    # ---- introspection ------------------------------------------------------------------------------
    def pool_stats(self) -> dict[str, int]:
        return self.scheduler.allocator.stats().as_dict()

    def check(self) -> None:
        """Assert the pool's invariants (tests call it after every scenario)."""
        self.scheduler.check()
