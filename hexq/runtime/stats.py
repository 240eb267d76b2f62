"""What `hexq run --stats` reports: RunStats, and the process's peak resident set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hexq.runtime.cache import CacheStats
from hexq.runtime.experts import PrefetchStats


@dataclass
class RunStats:
    """What `hexq run --stats` reports (tpot_seconds: the median decode step). Bytes: memory_bytes the whole budget
    (None without --memory), dense_bytes the materialized dense part, scratch_bytes the load and compute scratch,
    kv_bytes the KV cache planned for one sequence of `context` positions, budget_bytes the fast tier, peak_bytes its
    high-water mark; bytes_read what was read from the artifact's expert shards; peak_rss_bytes the process's VmHWM
    (None where /proc is missing). How it computed: cache_format (what the fast tier holds: packed codes, or bf16 /
    fp32 matrices), kernel_path (the CPU kernels' instruction-set path, or torch), decode_path (the native step, or
    the transformers model and why: hexq.runtime.native), threads, and the compute counters (rows computed from the
    codes, experts and dense products expanded)."""

    budget_bytes: int
    expert_bytes: int
    peak_bytes: int
    cache: CacheStats
    prefetch: PrefetchStats
    skipped_slots: int
    dense_bytes: int = 0
    scratch_bytes: int = 0
    kv_bytes: int = 0
    context: int = 0
    memory_bytes: int | None = None
    bytes_read: int = 0
    warm_experts: int = 0
    dtype: str = "bf16"
    cache_format: str = "packed"
    kernel_path: str = "torch"
    decode_path: str = "transformers"
    threads: int = 1
    gemv_rows: int = 0
    expanded_experts: int = 0
    expanded_dense: int = 0
    expand_from: dict = field(default_factory=dict)  # "expert" / "dense": the cost model's n_critical (tokens)
    peak_rss_bytes: int | None = None
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    tokens_per_second: float | None = None
    generated_tokens: int = 0
    native_profile: dict | None = None  # the native step's seconds per step (hexq.runtime.native.profile)

    def as_dict(self) -> dict:
        cache = asdict(self.cache)
        cache["hit_rate"] = self.cache.hit_rate
        layers = sorted(set(self.cache.layer_hits) | set(self.cache.layer_misses))
        cache["layer_hit_rate"] = {str(layer): self.cache.layer_hits.get(layer, 0)
                                   / max(1, self.cache.layer_hits.get(layer, 0) + self.cache.layer_misses.get(layer, 0))
                                   for layer in layers}
        out = {key: value for key, value in asdict(self).items() if key not in ("cache", "prefetch")}
        return out | {"cache": cache, "prefetch": {**asdict(self.prefetch), "precision": self.prefetch.precision,
                                                   "recall": self.prefetch.recall}}
