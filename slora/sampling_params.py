"""Per-request sampling parameters, validated once at construction."""
import math
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1",
                 self.max_tokens)
        _require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
                 "a finite number >= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "-1, 0 or a positive integer",
                 self.top_k)
        _require(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _require(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None", self.seed)
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "non-negative integers", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` of this request."""
        return None if self.seed is None else self.seed + index


def _require(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {got!r}")
