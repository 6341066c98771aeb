"""Per-request sampling parameters, validated once at construction."""
import math
import reprlib
from dataclasses import dataclass, field
from typing import TypeGuard

from slora.sampling.structured_output import StructuredOutput

# Seeds become int64 tensor elements in the sampler; a seed outside int64 would make the batched sampler
# raise on the engine thread.
MIN_SEED, MAX_SEED = -2 ** 63, 2 ** 63 - 1
# Any top_k at or above the vocabulary means "no top-k" (the sampler clamps it); the bound only keeps the
# value a plain integer that every layer (tensors, JSON clients) represents exactly.
MAX_TOP_K = 2 ** 31 - 1
FLOAT32_MAX = 3.4028234663852886e38     # temperatures become float32 tensor elements in the sampler
MAX_LOGPROBS = 20                       # top logprobs per position (OpenAI's bound)
MAX_PENALTY = 2.0                       # presence / frequency penalties lie in [-2, 2] (OpenAI's bound)
MAX_LENGTH_PENALTY = 10.0               # beam search's length penalty lies in [-10, 10]
MAX_LOGIT_BIAS = 100.0                  # logit_bias values lie in [-100, 100] (OpenAI's bound)


@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy. With `n > 1`, sample i uses seed `seed + i`,
    so each sample equals the same request run alone with that seed.

    Logprobs are those of the model's raw logits (log_softmax before penalties, biases, temperature and
    grammar masks), as vLLM's default. `logprobs=k`: each output token's logprob and the k most likely
    tokens at its position; `prompt_logprobs=k`: the same for the prompt's tokens (its first has none).
    `best_of`: that many samples run, and the n with the highest cumulative logprob are returned.
    `max_tokens=0` computes the prompt only (with prompt_logprobs, that is a loglikelihood).

    `use_beam_search`: `beam_width` beams (default: best_of or n) searched as transformers' `generate(num_beams=
    beam_width, length_penalty=..., early_stopping=...)` does; the best n finished beams are returned. It takes
    no sampling (temperature 0 or 1, no top-p/k, min-p), penalties, logit biases, grammars, stop strings or
    min_tokens; stop_token_ids and ignore_eos apply."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: no top-k filter
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0         # subtracted once from the logit of every token already output
    frequency_penalty: float = 0.0        # subtracted once per occurrence in the output so far
    repetition_penalty: float = 1.0       # vLLM's: logits of prompt and output tokens divided (>0) or multiplied
    min_tokens: int = 0                   # EOS and stop_token_ids are masked until this many tokens are out
    min_p: float = 0.0                    # tokens below min_p times the top token's probability are dropped
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    best_of: int | None = None
    structured: StructuredOutput | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False    # True, False or "never", as transformers'
    # stop_token_ids as a set: the stop check asks it for every token, and a request may list 1024 ids.
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _require(_is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens", "an integer >= 0",
                 self.max_tokens)
        _require(_is_finite(self.temperature) and self.temperature >= 0,
                 "temperature", "a finite number >= 0", self.temperature)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K, "top_k",
                 f"-1, 0 or a positive integer up to {MAX_TOP_K}", self.top_k)
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        self._check_controls()
        self._check_beam_search()
        self._check_seed()
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "non-negative integers", self.stop_token_ids)
        self.stop_token_set = frozenset(self.stop_token_ids)

    def _check_seed(self) -> None:
        """Every sample's seed (seed + i for i < best_of or n) must fit in int64."""
        if self.seed is None:
            return
        _require(_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED, "seed",
                 f"an integer in [{MIN_SEED}, {MAX_SEED}] or None", self.seed)
        samples = self.num_samples
        _require(self.seed + samples - 1 <= MAX_SEED, "seed",
                 f"at most {MAX_SEED} - (samples - 1) = {MAX_SEED - samples + 1} with {samples} samples "
                 f"(sample i uses seed + i)", self.seed)

    def _check_controls(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                     f"None or an integer in [0, {MAX_LOGPROBS}]", value)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_finite(value) and abs(value) <= MAX_PENALTY, name,
                     f"a number in [-{MAX_PENALTY}, {MAX_PENALTY}]", value)
        _require(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 "a finite number > 0", self.repetition_penalty)
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        self.logit_bias = dict(self.logit_bias or {})
        _require(all(_is_int(t) and t >= 0 and _is_finite(b) and abs(b) <= MAX_LOGIT_BIAS
                     for t, b in self.logit_bias.items()), "logit_bias",
                 f"token ids >= 0 mapped to numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]", self.logit_bias)
        _require(self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n), "best_of",
                 f"None or an integer >= n={self.n}", self.best_of)
        _require(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
                 "None or a StructuredOutput", self.structured)

    def _check_beam_search(self) -> None:
        _require(isinstance(self.use_beam_search, bool), "use_beam_search", "a bool", self.use_beam_search)
        # Scores divide by length ** length_penalty: beyond +-10 that power overflows a float at long lengths.
        _require(_is_finite(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
                 f"a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]", self.length_penalty)
        stopping = self.early_stopping
        _require(stopping is True or stopping is False or stopping == "never", "early_stopping",
                 'True, False or "never"', stopping)
        if not self.use_beam_search:
            for name, default in (("beam_width", None), ("length_penalty", 1.0), ("early_stopping", False)):
                _require(getattr(self, name) == default, name, f"{default} without use_beam_search",
                         getattr(self, name))
            return
        _require(self.beam_width is None or (_is_int(self.beam_width) and self.beam_width >= self.n),
                 "beam_width", f"None or an integer >= n={self.n}", self.beam_width)
        _require(self.max_tokens >= 1, "max_tokens", "at least 1 with use_beam_search", self.max_tokens)
        unsupported = [name for name, value, default in self._beam_excluded() if value != default]
        if unsupported:
            raise ValueError(f"use_beam_search does not support {', '.join(unsupported)}; beam search ranks "
                             "the model's own logprobs")

    def _beam_excluded(self) -> list[tuple[str, object, object]]:
        """(field, value, the value beam search needs) of what it does not combine with."""
        temperature = 1.0 if self.temperature in (0, 1) else self.temperature
        return [("temperature other than 0 or 1", temperature, 1.0), ("top_p", self.top_p, 1.0),
                ("top_k", max(self.top_k, 0), 0), ("min_p", self.min_p, 0.0),
                ("presence_penalty", self.presence_penalty, 0.0), ("frequency_penalty", self.frequency_penalty, 0.0),
                ("repetition_penalty", self.repetition_penalty, 1.0), ("logit_bias", self.logit_bias, {}),
                ("structured output", self.structured, None), ("stop strings", self.stop, []),
                ("min_tokens", self.min_tokens, 0)]

    @property
    def num_samples(self) -> int:
        """Sequences that run: the beams of a beam search (beam_width, else best_of or n), else best_of samples
        when given (n are returned)."""
        if self.use_beam_search:
            return self.beam_width or self.best_of or self.n
        return self.best_of or self.n

    @property
    def beam_search_width(self) -> int | None:
        return self.num_samples if self.use_beam_search else None

    @property
    def logprob_count(self) -> int | None:
        """Top logprobs the sampler computes per token: `logprobs`, or 0 where only best_of needs the token's
        own (to rank the samples); None: none."""
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.num_samples > self.n else None

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (the sampler then counts them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` of this request."""
        return None if self.seed is None else self.seed + index


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A number that float32 tensors can hold: not inf or NaN, and no int too large for a float (10**400)."""
    try:
        return _is_number(value) and math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:
        return False


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {reprlib.repr(got)}")   # bounded echo
