"""Request traces for the benchmarks. Seeded, no global random state.

S-LoRA's synthetic trace (`slora_trace`), following S-LoRA's own generator: one Gamma arrival process with
rate `R` (requests/s) and coefficient of variation `cv` (inter-arrival times ~ Gamma(shape=1/cv^2,
scale=cv^2/R), so their mean is 1/R and their CV is cv), each request's adapter
`int(power(alpha) * n)` (alpha = 1 is uniform popularity, smaller is more skewed towards low indices),
input and output lengths uniform in [8, 512] (both ends included). Adapters have rank 8, or (`rank_mix`)
a rank drawn once per adapter, uniformly from {8, 16, 32, 64}, from a second stream of the same seed.

The long-tailed trace (`long_tail_trace`): log-normal prompt and output lengths whose parameters are
derived from the target statistics (z = 1.6449 is the 95th percentile of the standard normal):

    prompt: median 584, p95 2,155  ->  mu = ln 584 = 6.3699,  sigma = ln(2155 / 584) / z = 0.7937
    output: mean 374,   p95 1,118  ->  ln p95 - ln mean = z sigma - sigma^2 / 2, a quadratic in sigma whose
            smaller root is sigma = 0.9268 (the larger, 2.36, would put the median at 25 tokens);
            mu = ln 374 - sigma^2 / 2 = 5.4948 (median 243)

Lengths are rounded to integers >= 1 and clipped so that prompt + output <= `max_total` (4,096): the output
is first capped at `max_total - 1`, then the prompt is truncated to what is left (as a server truncates
an over-long context), which touches about 1% of the requests.
"""
import math
from dataclasses import dataclass

import numpy as np

SEED = 42
RANKS = (8, 16, 32, 64)
Z95 = 1.6448536269514722               # standard normal 95th percentile


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int
    adapter: int | None                # adapter index in [0, n), None = base model
    rank: int                          # LoRA rank of that adapter, 0 for the base model
    arrival: float                     # seconds from the start of the trace


@dataclass(frozen=True)
class LogNormal:
    mu: float
    sigma: float

    @classmethod
    def from_median_p95(cls, median: float, p95: float) -> "LogNormal":
        return cls(math.log(median), math.log(p95 / median) / Z95)

    @classmethod
    def from_mean_p95(cls, mean: float, p95: float) -> "LogNormal":
        # ln p95 = mu + z s and ln mean = mu + s^2 / 2  =>  s^2 / 2 - z s + ln(p95 / mean) = 0
        gap = math.log(p95 / mean)
        disc = Z95 * Z95 - 2 * gap
        if disc < 0:
            raise ValueError(f"no log-normal has mean {mean} and p95 {p95}")
        sigma = Z95 - math.sqrt(disc)
        return cls(math.log(mean) - sigma * sigma / 2, sigma)

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma ** 2 / 2)

    @property
    def p95(self) -> float:
        return math.exp(self.mu + Z95 * self.sigma)


PROMPT_DIST = LogNormal.from_median_p95(584, 2155)
OUTPUT_DIST = LogNormal.from_mean_p95(374, 1118)


def gamma_arrivals(rng: np.random.RandomState, count: int, rate: float, cv: float) -> np.ndarray:
    """Arrival times of `count` requests from a Gamma renewal process with mean rate `rate` and CV `cv`."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), count))


def adapter_ranks(num_adapters: int, rank_mix: bool, seed: int = SEED) -> list[int]:
    """The rank of each adapter: 8, or drawn uniformly from RANKS with a stream of its own."""
    if not rank_mix:
        return [RANKS[0]] * num_adapters
    rng = np.random.RandomState(seed + 1)
    return [int(RANKS[i]) for i in rng.randint(0, len(RANKS), num_adapters)]


def slora_trace(num_requests: int, num_adapters: int, rate: float, cv: float = 1.0, alpha: float = 1.0,
                rank_mix: bool = False, length_range: tuple[int, int] = (8, 512),
                seed: int = SEED) -> list[Request]:
    """S-LoRA's synthetic trace; draw order as in S-LoRA (adapters, inputs, outputs, intervals)."""
    if num_adapters < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
    rng = np.random.RandomState(seed)
    adapters = np.minimum((rng.power(alpha, num_requests) * num_adapters).astype(int), num_adapters - 1)
    low, high = length_range
    inputs = rng.randint(low, high + 1, num_requests)
    outputs = rng.randint(low, high + 1, num_requests)
    arrivals = gamma_arrivals(rng, num_requests, rate, cv)
    ranks = adapter_ranks(num_adapters, rank_mix, seed)
    return [Request(int(p), int(o), int(a), ranks[a], float(t))
            for p, o, a, t in zip(inputs, outputs, adapters, arrivals)]


def clip_lengths(prompt: int, output: int, max_total: int) -> tuple[int, int]:
    """Clip so that prompt + output <= max_total, both >= 1: the output first, then the prompt."""
    output = max(1, min(output, max_total - 1))
    prompt = max(1, min(prompt, max_total - output))
    return prompt, output


def long_tail_trace(num_requests: int, max_total: int = 4096, rate: float | None = None, cv: float = 1.0,
                    seed: int = SEED) -> list[Request]:
    """The long-tailed trace, base model only; all arrivals at 0 unless `rate` is given."""
    rng = np.random.RandomState(seed)
    prompts = np.rint(rng.lognormal(PROMPT_DIST.mu, PROMPT_DIST.sigma, num_requests)).astype(int)
    outputs = np.rint(rng.lognormal(OUTPUT_DIST.mu, OUTPUT_DIST.sigma, num_requests)).astype(int)
    arrivals = gamma_arrivals(rng, num_requests, rate, cv) if rate else np.zeros(num_requests)
    requests = []
    for p, o, t in zip(prompts, outputs, arrivals):
        prompt, output = clip_lengths(int(p), int(o), max_total)
        requests.append(Request(prompt, output, None, 0, float(t)))
    return requests
