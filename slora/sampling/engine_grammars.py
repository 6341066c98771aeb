"""The engine's grammars: compiled specs started per sequence, the masks of a step, and the per-token budget.
The compiler is built on the first structured request: building the tokenizer's tables takes a while, most
engines never need them, and xgrammar is imported only then. A server compiles its requests' specs off the
engine's thread (`slora.sampling.grammar_service`) and hands them over compiled; the offline `LLM` compiles here."""
import functools
import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from slora.core.outputs import GRAMMAR_TOO_SLOW, RequestError
from slora.sampling.sampler import GrammarMask
from slora.sampling.structured_output import StructuredOutput

if TYPE_CHECKING:
    from slora.sampling.grammar import CompiledGrammar, GrammarCompiler

logger = logging.getLogger(__name__)


class EngineGrammars:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 eos_token_ids: Collection[int], token_budget_s: float, slow_tokens: int) -> None:
        self._tokenizer, self._vocab_size, self._eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.token_budget_s = token_budget_s      # a row's accepts and mask fill for one token
        self.slow_tokens = slow_tokens            # tokens in a row over that budget that end its request

    @functools.cached_property
    def compiler(self) -> "GrammarCompiler":
        if self._tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        from slora.sampling.grammar import GrammarCompiler
        return GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids,
                               token_budget_s=self.token_budget_s)

    def start(self, spec: StructuredOutput, compiled: "CompiledGrammar | None" = None) -> GrammarMask:
        """A fresh state of the spec's grammar, compiled here (once per spec) unless given compiled;
        ValueError for an invalid spec."""
        if compiled is not None and compiled.spec != spec:
            raise ValueError("the compiled grammar given is not the request's structured output")
        return self.compiler.start(compiled or self.compiler.compile(spec))

    def mask(self, logits: Tensor, grammars: Sequence[GrammarMask | None]) -> None:
        self.compiler.mask(logits, grammars)

    def too_slow(self, grammars: Sequence[GrammarMask | None]) -> list[tuple[int, str]]:
        """(row, spec kind) of the rows whose grammar went over the per-token budget `slow_tokens` times in a
        row: their requests end, so that no other row's steps wait on them again."""
        return [(row, g.kind) for row, g in enumerate(grammars) if g is not None and g.slow_tokens >= self.slow_tokens]

    def slow_failures(self, request_ids: Sequence[str],
                      grammars: Sequence[GrammarMask | None]) -> list[tuple[str, RequestError]]:
        """The requests (row i: request_ids[i]) to fail because their grammar is too slow: its work runs
        inside every step, so one such grammar would slow every other request."""
        budget_ms, failures = self.token_budget_s * 1e3, []
        for row, kind in self.too_slow(grammars):
            logger.warning("request %s: its %s took over %g ms per token for %d tokens; it is stopped",
                           request_ids[row], kind, budget_ms, self.slow_tokens)
            failures.append((request_ids[row], RequestError(
                GRAMMAR_TOO_SLOW, f"the structured output's {kind} took more than {budget_ms:g} ms per token "
                                  f"for {self.slow_tokens} tokens in a row, the server's limit; simplify it")))
        return failures
