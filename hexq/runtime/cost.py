"""Fill-or-bypass cost model for a missing expert (paper 003 §III.C.1, eq. 7-8).

When the router selects an expert that is not resident, there are two ways to run it on n tokens:

    slow path (no fill):  T_slow = n * lat_slow                      (eq. 7, 003's T_CPU)
    fill path:            T_fill = T_e + n * lat_fast                (eq. 8, 003's T_sum)

where lat_slow / lat_fast are the per-token latencies of computing the expert without / with a cache fill, and
T_e is the one-off cost of the fill (read, unpack, dequantize into the cache). Filling pays off when
T_slow > T_fill, i.e. when n exceeds the critical token count

    n_critical = T_e / (lat_slow - lat_fast)          (lat_slow > lat_fast; otherwise filling never pays off).

Decode (n = 1) usually stays below n_critical, prefill usually above it. The latencies are measured once at start-up
by `measure_latency`, which times tiny runs of callables the runtime supplies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LatencyProfile:
    """Measured costs, in seconds: per token on the slow and fast paths, and T_e for one expert fill."""

    lat_slow_per_token: float
    lat_fast_per_token: float
    fill_seconds: float

    def __post_init__(self) -> None:
        for name in ("lat_slow_per_token", "lat_fast_per_token", "fill_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def n_critical(profile: LatencyProfile) -> float:
    """Token count above which a fill is faster than the slow path (eq. 7-8); inf if it never is."""
    gap = profile.lat_slow_per_token - profile.lat_fast_per_token
    if gap <= 0:
        return math.inf
    return profile.fill_seconds / gap


def should_fill(n_tokens: int, profile: LatencyProfile) -> bool:
    """True if T_fill = T_e + n lat_fast < T_slow = n lat_slow (eq. 7-8); a tie keeps the slow path (no I/O)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    t_slow = n_tokens * profile.lat_slow_per_token
    t_fill = profile.fill_seconds + n_tokens * profile.lat_fast_per_token
    return t_slow > t_fill


def _fastest_seconds(fn: Callable[[], Any], repeats: int, warmup: int, clock: Callable[[], float]) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    # the fastest run: other work on a shared machine only ever adds time, and a profile measured under load
    # is kept (hexq.runtime.compute.cached_profile)
    return min(samples)


def measure_latency(run_slow: Callable[[int], Any], run_fast: Callable[[int], Any], run_fill: Callable[[], Any], *,
                    n_tokens: int = 8, fast_tokens: int | None = None, repeats: int = 5, warmup: int = 1,
                    clock: Callable[[], float] = time.perf_counter) -> LatencyProfile:
    """Time tiny runs and return the LatencyProfile (003 §III.C.1 "offline analysis or online calibration").

    run_slow(n) / run_fast(n) compute one expert on n tokens without / with a resident copy; run_fill() fills one
    expert. Each is run `warmup` times untimed, then `repeats` times; the fastest is kept and per-token latencies
    are taken from it. The fast path: its time on fast_tokens (default n_tokens) over fast_tokens: a matrix
    product's per-token cost falls with the token count until its fixed cost is amortised, so timing it on as many
    tokens as the choice is about (a prefill's) keeps n_critical honest. The slow path: its marginal cost,
    (T(4 n_tokens) - T(n_tokens)) / (3 n_tokens): a layer's experts computed from the codes share one call, whose
    fixed cost (waking the pool, gathering the tokens) is not any one expert's, and charged to one it made the codes
    look 2-3x slower than they are and sent prefill experts of ~8 tokens to the expansion. `clock` is injectable so
    tests need not sleep.
    """
    fast_tokens = n_tokens if fast_tokens is None else fast_tokens
    if n_tokens <= 0 or fast_tokens <= 0 or repeats <= 0 or warmup < 0:
        raise ValueError(f"need token counts > 0, repeats > 0, warmup >= 0; got {n_tokens}, {fast_tokens}, "
                         f"{repeats}, {warmup}")
    few = _fastest_seconds(lambda: run_slow(n_tokens), repeats, warmup, clock)
    many = _fastest_seconds(lambda: run_slow(4 * n_tokens), repeats, warmup, clock)
    slow = max(many - few, 0.0) / (3 * n_tokens)
    fast = _fastest_seconds(lambda: run_fast(fast_tokens), repeats, warmup, clock) / fast_tokens
    fill = _fastest_seconds(run_fill, repeats, warmup, clock)
    return LatencyProfile(lat_slow_per_token=slow, lat_fast_per_token=fast, fill_seconds=fill)


# ------------------------------------------------------------------------------------------ per-miss admission (CPU)
#
# On the CPU runtime a missing expert is computed from compute-ready weights either way: written into a cache slot
# (fill) or into the transient bypass buffer. Both dequantize once and run the same kernel, so eq. 7-8's two sides
# are equal for the current n tokens (T_slow(n) = T_fill(n) = T_e + n lat) and what differs is the future: a fill
# saves the next load of the new expert and forces the next load of the experts it evicts. Over the next token the
# expected extra load time is, with u the expected uses per token and T_e the measured load time,
#
#     fill:      sum over victims v of  u_v T_e(v)        bypass:    u_new T_e(new)
#
# so the miss fills iff u_new T_e(new) > sum_v u_v T_e(v) (a tie keeps the transient load: no churn). This is the
# cost-model form of frequency-based admission in front of LRU: the LRU picks the victims, the usage estimates decide
# whether the newcomer is worth them. On CUDA, eq. 7-8 in 003's own form (T_CPU against T_sum, `should_fill`) decides
# where a cold expert is computed.


def admit_fill(new_usage: float, new_load_seconds: float, victims: list[tuple[float, float]]) -> bool:
    """Fill a missing expert at the cost of evicting `victims` [(usage, load seconds)]? (see the comment above)"""
    if new_usage < 0 or new_load_seconds < 0 or any(u < 0 or t < 0 for u, t in victims):
        raise ValueError("usage and load seconds must be >= 0")
    return new_usage * new_load_seconds > sum(u * t for u, t in victims)


def usage_update(usage: torch.Tensor, counts: torch.Tensor, tokens: int, horizon: float) -> torch.Tensor:
    """Expected uses per token of each expert, an exponential moving average over the last ~`horizon` tokens:
    u <- d^T u + (1 - d^T) c / T with d = 1 - 1/horizon, for `counts` c [E] of one forward pass over T tokens (a pass
    of T tokens weighs as T single-token steps)."""
    if tokens <= 0:
        return usage
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1 token, got {horizon}")
    keep = (1.0 - 1.0 / horizon) ** tokens
    return usage * keep + counts.to(usage.dtype) * ((1.0 - keep) / tokens)


def calibration_usage(counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """[L, E] expected uses per token from calibration router counts [L, E] (each token routes top_k slots per
    layer): the prior the runtime's estimates start from."""
    tokens = counts.sum(dim=1, keepdim=True).double() / top_k
    return torch.where(tokens > 0, counts.double() / tokens.clamp(min=1), torch.zeros_like(tokens))
