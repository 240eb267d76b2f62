"""What `hexq run --stats` reports: RunStats, and the process's peak resident set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hexq.runtime.cache import CacheStats
from hexq.runtime.experts import PrefetchStats
from hexq.runtime.memory import MemoryPlan


@dataclass
class RunStats:
    """What `hexq run --stats` reports (tpot_seconds: the median decode step). Bytes: the memory plan (its fields,
    hexq.runtime.memory.MemoryPlan, are reported at the top level: memory_bytes, dense_bytes, scratch_bytes,
    kv_bytes, context, expert_bytes, fast_tier_bytes, arena), peak_bytes the fast tier's high-water mark;
    bytes_read what was read from the artifact's expert shards; peak_rss_bytes the process's VmHWM
    (None where /proc is missing). How it computed: cache_format (what the fast tier holds: packed codes, or bf16 /
    fp32 matrices), kernel_path (the CPU kernels' instruction-set path, or torch), decode_path (the native step, or
    the transformers model and why: hexq.runtime.native), threads, and the compute counters (rows computed from the
    codes, experts and dense products expanded)."""

    plan: MemoryPlan
    peak_bytes: int
    cache: CacheStats
    prefetch: PrefetchStats
    skipped_slots: int
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
        out = {key: value for key, value in asdict(self).items() if key not in ("plan", "cache", "prefetch")}
        prefetch = {**asdict(self.prefetch), "precision": self.prefetch.precision, "recall": self.prefetch.recall}
        return asdict(self.plan) | out | {"cache": cache, "prefetch": prefetch}
