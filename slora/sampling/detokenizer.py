"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole output."""
from collections.abc import Callable
from typing import cast

from transformers import PreTrainedTokenizerBase

# Tokens kept before the new ones, so that tokenizers which strip a leading space at the start of a
# decode (SentencePiece) see the same context as in a full decode.
_CONTEXT_TOKENS = 5


def fast_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight through the Rust tokenizer when that gives
    the same string: a fast tokenizer whose class keeps transformers' own decode (some, like Whisper's,
    override it) and that does not clean up tokenization spaces. transformers' wrapper costs several
    times the decode itself, and the detokenizer decodes twice per generated token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _plain_fast_decode(tokenizer) and not tokenizer.clean_up_tokenization_spaces:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    # transformers types decode without overloads (str | list[str]); a list of ids decodes to one str.
    return lambda ids: cast(str, tokenizer.decode(ids, skip_special_tokens=True))


def _plain_fast_decode(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether decoding is transformers' fast-tokenizer decode, not overridden by a subclass."""
    try:       # the class of transformers 5's fast tokenizers; other versions take the plain decode
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is TokenizersBackend.decode)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._decode = fast_decoder(tokenizer) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0          # start of the window decoded for context
        self._read_offset = 0            # tokens before this one are already in `text`

    def add(self, token_id: int) -> str:
        """Append a token; returns the text so far (a partial UTF-8 character is held back)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return self.text
        assert self._decode is not None, "set with the tokenizer"
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self._prefix_offset = max(0, len(self.token_ids) - _CONTEXT_TOKENS)
            self._read_offset = len(self.token_ids)
        return self.text

    def hold(self, token_id: int) -> str:
        """Append a token without decoding it (the text is wanted only at the end); returns the text so
        far, which stays as it was."""
        self.token_ids.append(token_id)
        return self.text

    def final_text(self) -> str:
        """The exact decode of every token, once the sequence has ended."""
        if self.tokenizer is None:
            return ""
        assert self._decode is not None, "set with the tokenizer"
        self.text = self._decode(self.token_ids)
        return self.text
