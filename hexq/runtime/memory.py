"""The memory plan of `hexq run`: what each part of the process may take, decided once, before anything is allocated.

`--memory` is one budget for everything hexq allocates:

    memory_bytes = dense_bytes + scratch_bytes + kv_bytes + fast_tier_bytes

the dense part (attention, norms, routers, shared experts, head), the load, compute and prefill scratch, the KV
cache of one sequence of `context` positions, and the fast tier (the expert cache), which gets the rest.
`--fast-tier` gives the fast tier alone (the rest is then whatever it takes); neither: room for every expert at its
allocated width. The plan is frozen: the runtime, its cache (whose FastTier counts the bytes against
fast_tier_bytes), the native step and `--stats` all read this one object.
"""

from __future__ import annotations

from dataclasses import dataclass

from hexq.base.errors import HexqError
from hexq.base.units import format_bytes
from hexq.runtime.compute import FROM_CODES_ROWS


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part (see the module docstring). expert_bytes: every expert at its allocated width as the fast tier
    holds it; memory_bytes: --memory (None without it); arena: the experts live in the device's expert arena
    (hexq.runtime.arena), outside the cache, whose fast tier is then empty."""

    dense_bytes: int
    scratch_bytes: int
    kv_bytes: int
    context: int
    expert_bytes: int
    fast_tier_bytes: int
    memory_bytes: int | None = None
    arena: bool = False

    @property
    def cache_bytes(self) -> int:
        """What the expert cache may hold: the fast tier, unless the experts are in the device's arena."""
        return 0 if self.arena else self.fast_tier_bytes

    @property
    def holds_every_expert(self) -> bool:
        return self.fast_tier_bytes >= self.expert_bytes


# What a prefill's passes take of the process's RSS per byte a pass allocates at its peak: the C allocator keeps
# freed blocks for reuse and each pass's differ in size as the KV cache grows; after each pass the freed heap is
# handed back (hexq.base.devices.return_freed_memory). Measured on a 6-layer Qwen3-30B-A3B shape (AMD EPYC,
# `--memory 566MB`, a 3,900-token prompt in 16 passes whose torch allocations peaked at 31 MiB, bound 67): peak RSS
# 541 MiB over the interpreter's baseline with the plan at 540 (the planned KV cache and fast tier full); with the plan
# at twice the bound, 515 MiB with the trim and 545 without.
RETAINED = 1.5


def prefill_scratch_nbytes(config, artifact, tokens: int, context: int, dtype, fused: bool, threads: int) -> int:
    """What the prefill passes of `tokens` tokens at up to `context` positions take: RETAINED times what one pass
    allocates, which this bounds from above. Per token:
    in the compute dtype 8 hidden-size vectors (residual, norms, attention and MoE outputs and their sums), the
    queries, keys, values and attention output, and 3 rows of the family's dense intermediate (a shared expert or
    a dense layer); the router's float32 logits and probabilities; the top_k routed rows gathered (compute dtype)
    with their float32 outputs and weighted sum (hexq.runtime.experts); the boolean mask's row of positions. Per
    pass: the routed rows computed from the codes at a time (hexq.runtime.compute.FROM_CODES_ROWS), float32, with
    their quantized copies and their gate/up outputs, SiLU-products and its quantized copy; and the attention's own:
    `fused` (hexq.model.attention.fused_on), torch's fused CPU kernel, whose `threads` each hold a block of at
    most 256 queries x 512 positions of float32 scores and their compute-dtype copy plus the queries' float32
    outputs; else SDPA's math path, heads x tokens x positions float32 scores, and the key-value heads repeated
    for the query heads.
    Measured on a 6-layer Qwen3-30B-A3B shape (AMD EPYC, 2 threads, `--memory 540MiB`), the last pass of 256 tokens
    at 768 positions: 40 MiB of torch allocations at its peak, 9 of them the grown KV cache (planned with the KV
    cache); the bound is 67 MiB at 4,096 positions (the math path's: 257 MiB)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    top_k, inner = artifact.top_k, max(rows for rows, _ in artifact.expert_shapes) // 2  # gate_up is [2I, H]
    per_token = (dtype.itemsize * (8 * hidden + (2 * heads + 2 * kv_heads) * head_dim
                                   + 3 * (getattr(config, "intermediate_size", None) or 0))
                 + 8 * artifact.num_experts + top_k * hidden * (dtype.itemsize + 4) + 4 * hidden + context)
    window = min(tokens * top_k, FROM_CODES_ROWS) * 4 * (2 * hidden + 4 * inner)
    if fused:
        attention = threads * min(tokens, 256) * (512 * (4 + dtype.itemsize) + 4 * head_dim + 8)
    else:
        repeated = 2 * heads * context * head_dim * dtype.itemsize if kv_heads < heads else 0
        attention = tokens * heads * context * 4 + repeated
    return int(RETAINED * (tokens * per_token + window + attention))


def head_dims(config) -> tuple[int, int]:
    """(key, value) width per attention head: deepseek's MLA caches wider keys than values."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return getattr(config, "qk_head_dim", None) or head_dim, getattr(config, "v_head_dim", None) or head_dim


def kv_position_bytes(config, dtype, native) -> int:
    """Bytes one position of one sequence takes in the KV caches: keys and values of every layer's key-value heads,
    in the compute dtype (the transformers path's cache) plus the native step's `native` (which the prompt's cache
    is copied into: both exist at the handover)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    key_dim, value_dim = head_dims(config)
    return config.num_hidden_layers * heads * (key_dim + value_dim) * (dtype.itemsize + native.itemsize)


def check_memory_flags(memory_bytes: int | None, fast_tier_bytes: int | None) -> None:
    """--memory sizes the whole process, --fast-tier the experts alone: at most one of them."""
    if memory_bytes is not None and fast_tier_bytes is not None:
        raise HexqError("give --memory (the whole process) or --fast-tier (the experts alone), not both")


def plan_memory(*, memory_bytes: int | None, fast_tier_bytes: int | None, dense_bytes: int, scratch_bytes: int,
                kv_bytes: int, context: int, expert_bytes: int, largest_slot: int, cache_format: str,
                cached: bool = True, arena_possible: bool = False) -> MemoryPlan:
    """The plan for --memory or --fast-tier (at most one). `largest_slot`: the bytes of the largest expert the fast
    tier may hold (the least it must take); `cached`: the experts are served from the cache (mode "cache"), else
    the fast tier is empty; `arena_possible`: a device that keeps every expert in one arena when the
    fast tier holds them all."""
    check_memory_flags(memory_bytes, fast_tier_bytes)
    if memory_bytes is not None:
        fast_tier = memory_bytes - dense_bytes - scratch_bytes - kv_bytes
        if fast_tier < largest_slot:
            minimum = dense_bytes + scratch_bytes + kv_bytes + largest_slot
            raise HexqError(f"--memory {format_bytes(memory_bytes)} is below the minimum of "
                            f"{format_bytes(minimum)} ({minimum} bytes): the dense part takes "
                            f"{format_bytes(dense_bytes)}, one expert {format_bytes(largest_slot)} ({cache_format}), "
                            f"the scratch {format_bytes(scratch_bytes)} and the KV cache of {context} positions "
                            f"{format_bytes(kv_bytes)} (--context)")
    else:
        fast_tier = expert_bytes if fast_tier_bytes is None else fast_tier_bytes
        if fast_tier < largest_slot:
            raise HexqError(f"--fast-tier {format_bytes(fast_tier)} cannot hold one expert; the minimum is "
                            f"{format_bytes(largest_slot)} ({largest_slot} bytes, {cache_format}); all experts take "
                            f"{format_bytes(expert_bytes)}")
    fast_tier = min(fast_tier, expert_bytes) if cached else 0
    return MemoryPlan(dense_bytes, scratch_bytes, kv_bytes, context, expert_bytes, fast_tier, memory_bytes,
                      arena=arena_possible and cached and fast_tier >= expert_bytes)
