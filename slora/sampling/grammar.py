"""Structured output on xgrammar: a request's `StructuredOutput` compiled against the tokenizer, one matcher
per sequence, and the next-token masks of a step's rows applied to its logits as one bitmask
`[rows, ceil(vocab / 32)]` int32 (bit set: allowed).

The kinds: `json_schema` (xgrammar's strict mode: no properties or items beyond the schema's), `json_object`
(any JSON object), `regex` (matched whole), `choice` (exactly one of the strings) and `grammar` (xgrammar's
EBNF, GBNF-like, whose start rule is `root`). JSON may hold whitespace between its tokens, at most
`JSON_MAX_WHITESPACE` characters at a time: room for indentation, none for the endless whitespace that small
models fall into under an any-whitespace grammar. Once the output is complete and nothing but the end may
follow, only the EOS tokens are allowed.
"""
import functools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xgrammar as xgr
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from slora.execution.device_copy import to_device
from slora.sampling.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

JSON_MAX_WHITESPACE = 16      # characters of whitespace between two JSON tokens
MAX_ERROR_CHARS = 200         # of the library's message in a ValueError: the spec is tenant input
SPEC_NAMES = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled against one tokenizer; shared by every sequence that uses the spec."""

    spec: StructuredOutput
    grammar: xgr.CompiledGrammar


class _BitmaskFiller(Protocol):
    def fill_bitmask(self, bitmask: Tensor, row: int) -> None: ...


class GrammarViolation(RuntimeError):
    """A token was appended that the grammar forbids: sampled under a mask that should have excluded it."""


class GrammarState:
    """One sequence's place in its grammar. The engine `push`es each output token as it is appended, and the
    matcher takes it at the next `fill_bitmask` (or `settle`): that runs while the GPU computes the next
    step, where an accept right after sampling would keep the GPU waiting. A preempted sequence whose tokens
    are recomputed keeps its state and is not fed them again. Children of a prompt (n > 1) each take `fork()`
    of the state the prompt left (a fresh one)."""

    def __init__(self, matcher: xgr.GrammarMatcher, stop_words: Tensor, kind: str = "grammar") -> None:
        self._matcher = matcher
        self._stop_words = stop_words      # [words] int32: the bits of the EOS tokens
        self._pending: list[int] = []      # pushed, not yet taken by the matcher
        self.kind = kind                   # the spec's kind, for the message of a grammar that is too slow
        self.slow_tokens = 0               # tokens in a row whose accept and mask took longer than the budget

    def note_token_time(self, seconds: float, budget_s: float) -> None:
        """Count one token's grammar work against the per-token budget: a streak of slow tokens, reset by a
        fast one."""
        self.slow_tokens = self.slow_tokens + 1 if seconds > budget_s else 0

    def push(self, token_id: int) -> None:
        """`token_id` was appended to the output; the matcher takes it later (GrammarViolation then if it
        may not)."""
        self._pending.append(token_id)

    def settle(self) -> None:
        """Feed the matcher the pushed tokens; GrammarViolation for one it forbids."""
        while self._pending:
            if not self._matcher.accept_token(self._pending[0]):      # it stays pending: raised again
                raise GrammarViolation(f"token {self._pending[0]} was sampled under a grammar mask that forbids it")
            self._pending.pop(0)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id` now; False (the state unchanged) where the grammar forbids it."""
        self.settle()
        return self._matcher.accept_token(token_id)

    def is_finished(self) -> bool:
        """Whether the output is complete and only the end (an EOS token) may follow."""
        self.settle()
        return self._matcher.is_terminated() or (self._matcher.is_completed() and self._only_end_left())

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (a CPU tensor of `allocate_bitmask`)."""
        self.settle()
        if self._matcher.is_terminated():          # an EOS was accepted: nothing but the end again
            bitmask[row].copy_(self._stop_words)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def matcher(self) -> "xgr.GrammarMatcher | None":
        """The library's matcher, settled, while it can take tokens (None once terminated), for batched
        fills."""
        self.settle()
        return None if self._matcher.is_terminated() else self._matcher

    def fork(self) -> "GrammarState":
        """An independent copy of this state."""
        self.settle()
        return GrammarState(self._matcher.fork(), self._stop_words, self.kind)

    def _only_end_left(self) -> bool:
        words = torch.empty((1, self._stop_words.numel()), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(words, 0)
        return not bool((words[0] & ~self._stop_words).any())


class GrammarCompiler:
    """Compiles specs against the engine's tokenizer (thread-safe, with an LRU cache of `cache_size`
    grammars), starts sequences' states, and masks a step's logits. `vocab_size` is the logits' width: ids
    the tokenizer lacks (padding) are never allowed. The EOS tokens are the tokenizer's unless given. The
    tokenizer's tables are built on the first compile only: a server's grammars come compiled from
    `slora.sampling.grammar_service`, and starting or masking needs none. A row whose accepts and mask fill take
    longer than `token_budget_s` counts a slow token on its state (`GrammarState.slow_tokens`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: Collection[int] | None = None, cache_size: int = 128,
                 token_budget_s: float = float("inf")) -> None:
        self._tokenizer = tokenizer
        self.stop_ids = stop_ids(tokenizer, eos_token_ids)
        self.vocab_size = vocab_size
        self.token_budget_s = token_budget_s
        self._stop_words = _token_words(self.stop_ids, vocab_size)
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._batch = xgr.BatchGrammarMatcher()          # threads: half the machine's cores
        self._buffer: Tensor | None = None

    @functools.cached_property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        return tokenizer_info(self._tokenizer, self.vocab_size, self.stop_ids)

    @functools.cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        return xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                   cache_enabled=False)

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it is there; ValueError for an invalid spec."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            xgr_compiler = self._compiler                 # built once, under the lock
        compiled = CompiledGrammar(spec, compile_spec(xgr_compiler, spec))
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)     # a thread that compiled it meanwhile wins
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def start(self, compiled: CompiledGrammar) -> GrammarState:
        """A sequence's state at the start of its output."""
        return GrammarState(xgr.GrammarMatcher(compiled.grammar), self._stop_words, compiled.spec.kind)

    def mask(self, logits: Tensor, grammars: Sequence[_BitmaskFiller | None]) -> None:
        """Mask each row of `logits` `[rows, vocab]` to its grammar's next tokens; rows of None untouched.
        The rows' masks are filled by the library's thread pool, into a reused (pinned, on CUDA) buffer. Each
        row's work (the accepts of its pushed tokens, then its fill) is timed against the token budget."""
        bitmask = self._bitmask(len(grammars), logits.device)
        rows, live_rows, matchers, seconds = [], [], [], {}
        for row, grammar in enumerate(grammars):
            if grammar is None:
                continue
            rows.append(row)
            began = time.perf_counter()
            matcher = _matcher_of(grammar)                     # settled: its pushed tokens accepted
            seconds[row] = time.perf_counter() - began
            if matcher is None:                                # terminated: its EOS-only row
                grammar.fill_bitmask(bitmask, row)
            else:
                live_rows.append(row)
                matchers.append(matcher)
        if matchers:
            self._fill(bitmask, live_rows, matchers, seconds)
        self._note_times(grammars, seconds)
        every_row = len(rows) == len(grammars)         # no index list to copy
        apply_bitmask(logits, bitmask, None if every_row else torch.tensor(rows, dtype=torch.int32))

    def _fill(self, bitmask: Tensor, rows: list[int], matchers: list[xgr.GrammarMatcher],
              seconds: dict[int, float]) -> None:
        """The rows' masks in one batched fill. Only a batch slower than the budget is filled again row by
        row, to find which rows took the time (the batch's pool gives no time per row)."""
        began = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        if time.perf_counter() - began <= self.token_budget_s:
            return
        for row, matcher in zip(rows, matchers):
            began = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, row)
            seconds[row] += time.perf_counter() - began

    def _note_times(self, grammars: Sequence[_BitmaskFiller | None], seconds: dict[int, float]) -> None:
        for row, spent in seconds.items():
            grammar = grammars[row]
            if isinstance(grammar, GrammarState):
                grammar.note_token_time(spent, self.token_budget_s)

    def _bitmask(self, rows: int, device: torch.device) -> Tensor:
        """`[rows, words]` of the step's bitmask buffer, all allowed; grown when a step has more rows. The
        previous step's copy to the device is done: its sampled ids were read on the host since."""
        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = allocate_bitmask(rows, self.vocab_size).pin_memory() if device.type == "cuda" \
                else allocate_bitmask(rows, self.vocab_size)
        view = self._buffer[:rows]
        view.fill_(-1)
        return view

def tokenizer_info(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """The tokenizer's tables as xgrammar compiles against them: `vocab_size` wide, `stop_ids` ending."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """`spec` compiled by `compiler`; ValueError naming the problem for an invalid spec."""
    began = time.perf_counter()
    try:
        grammar = _compile_kind(compiler, spec)
    except (RuntimeError, UnicodeError) as e:   # xgrammar's for any invalid spec; a lone surrogate
        raise ValueError(f"invalid {SPEC_NAMES[spec.kind]}: {_short(str(e))}") from None
    logger.debug("compiled a %s grammar in %.1f ms", spec.kind, (time.perf_counter() - began) * 1e3)
    return grammar


def _compile_kind(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(_json_text(str(spec.spec)), max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                            max_whitespace_cnt=JSON_MAX_WHITESPACE)
    if spec.kind == "regex":
        return compiler.compile_regex(str(spec.spec))
    if spec.kind == "choice":
        return compiler.compile_grammar(choice_grammar(tuple(spec.spec or ())))
    return compiler.compile_grammar(str(spec.spec))


def _matcher_of(grammar: object) -> "xgr.GrammarMatcher | None":
    return grammar.matcher if isinstance(grammar, GrammarState) else None


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar of exactly one of `choices`: an alternation of their JSON-escaped literals."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def allocate_bitmask(rows: int, vocab_size: int) -> Tensor:
    """A CPU bitmask `[rows, ceil(vocab_size / 32)]` int32 that allows every token."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor | None = None) -> None:
    """Set to -inf, in place, the logits of `logits` `[rows, vocab]` whose bit in the same row of `bitmask`
    is 0, on the logits' device (xgrammar's Triton kernel on CUDA, its C++ one on CPU); only the row indices
    `rows` when given, the others untouched."""
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"a bitmask of {bitmask.shape[-1] * 32} tokens cannot mask {logits.shape[-1]} logits")
    if rows is not None and rows.numel() == 0:
        return
    indices = None if rows is None else to_device(rows.to(torch.int32), logits.device)
    # Typed as a list, but its CPU and Triton backends take a tensor, which is copied without a sync.
    xgr.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device), vocab_size=logits.shape[-1],
                                    indices=indices)  # type: ignore[arg-type]


def _token_words(token_ids: Collection[int], vocab_size: int) -> Tensor:
    """The bitmask row `[words]` int32 that allows exactly `token_ids`."""
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    for token in token_ids:
        words[token // 32] |= np.uint32(1 << (token % 32))
    return torch.from_numpy(words.view(np.int32))


def stop_ids(tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int] | None) -> list[int]:
    stop = sorted(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
    if None in stop:
        raise ValueError("structured output needs EOS token ids, and the tokenizer has no EOS token")
    return stop


def _json_text(schema: str) -> str:
    """`schema` if it is JSON text (checked here, for a message that does not echo the schema)."""
    try:
        json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON schema: not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return schema


def _short(message: str) -> str:
    """The library's message without its source location, on one line and at most MAX_ERROR_CHARS long."""
    text = " ".join(_LIBRARY_PREFIX.sub("", message.strip()).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."

