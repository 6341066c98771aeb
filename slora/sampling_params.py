"""Per-request sampling parameters, validated once at construction."""
import math
import reprlib
from dataclasses import dataclass, field
from typing import TypeGuard

# Seeds become int64 tensor elements in the sampler; a seed outside int64 would make the batched sampler
# raise on the engine thread.
MIN_SEED, MAX_SEED = -2 ** 63, 2 ** 63 - 1
# Any top_k at or above the vocabulary means "no top-k" (the sampler clamps it); the bound only keeps the
# value a plain integer that every layer (tensors, JSON clients) represents exactly.
MAX_TOP_K = 2 ** 31 - 1
FLOAT32_MAX = 3.4028234663852886e38     # temperatures become float32 tensor elements in the sampler


@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy. With `n > 1`, sample i uses seed `seed + i`,
    so each sample equals the same request run alone with that seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: no top-k filter
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    # stop_token_ids as a set: the stop check asks it for every token, and a request may list 1024 ids.
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1",
                 self.max_tokens)
        _require(_is_finite(self.temperature) and self.temperature >= 0,
                 "temperature", "a finite number >= 0", self.temperature)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K, "top_k",
                 f"-1, 0 or a positive integer up to {MAX_TOP_K}", self.top_k)
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        self._check_seed()
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "non-negative integers", self.stop_token_ids)
        self.stop_token_set = frozenset(self.stop_token_ids)

    def _check_seed(self) -> None:
        """Every sample's seed (seed + i for i < n) must fit in int64."""
        if self.seed is None:
            return
        _require(_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED, "seed",
                 f"an integer in [{MIN_SEED}, {MAX_SEED}] or None", self.seed)
        _require(self.seed + self.n - 1 <= MAX_SEED, "seed",
                 f"at most {MAX_SEED} - (n - 1) = {MAX_SEED - self.n + 1} with n={self.n} "
                 f"(sample i uses seed + i)", self.seed)

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
