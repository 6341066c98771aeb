"""The engine's grammar compiler, built on the first structured request: building the tokenizer's tables takes
a while, most engines never need them, and xgrammar is imported only then."""
import functools
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from slora.sampler import GrammarMask
from slora.structured_output import StructuredOutput

if TYPE_CHECKING:
    from slora.grammar import GrammarCompiler


class EngineGrammars:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 eos_token_ids: Collection[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos_token_ids = tokenizer, vocab_size, eos_token_ids

    @functools.cached_property
    def compiler(self) -> "GrammarCompiler":
        if self._tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        from slora.grammar import GrammarCompiler
        return GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids)

    def start(self, spec: StructuredOutput) -> GrammarMask:
        """A fresh state of the spec's grammar (compiled once per spec); ValueError for an invalid spec."""
        return self.compiler.start(self.compiler.compile(spec))

    def mask(self, logits: Tensor, grammars: Sequence[GrammarMask | None]) -> None:
        self.compiler.mask(logits, grammars)
