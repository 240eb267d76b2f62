"""The memory plan of `hexq run` (hexq.runtime.memory) and the one count of the fast tier's bytes (FastTier) that the
cache and the source's slot pools share."""

from __future__ import annotations

import pytest

from hexq.artifact.reader import Artifact
from hexq.base.errors import HexqError
from hexq.runtime.memory import plan_memory
from hexq.runtime.residency import FastTier
from hexq.runtime.source import ArtifactSource, SlotSizes

PARTS = {"dense_bytes": 1000, "scratch_bytes": 300, "kv_bytes": 200, "context": 16, "expert_bytes": 5000,
         "largest_slot": 400, "cache_format": "packed"}


def test_memory_is_split_once_and_the_fast_tier_gets_the_rest():
    plan = plan_memory(memory_bytes=3000, fast_tier_bytes=None, **PARTS)
    assert plan.fast_tier_bytes == 3000 - 1000 - 300 - 200 and plan.memory_bytes == 3000
    assert plan.cache_bytes == plan.fast_tier_bytes and not plan.holds_every_expert and not plan.arena
    # more than every expert needs: the fast tier is capped at the experts' bytes
    assert plan_memory(memory_bytes=10**6, fast_tier_bytes=None, **PARTS).fast_tier_bytes == 5000
    assert plan_memory(memory_bytes=None, fast_tier_bytes=None, **PARTS).fast_tier_bytes == 5000
    assert plan_memory(memory_bytes=None, fast_tier_bytes=800, **PARTS).fast_tier_bytes == 800
    # no cache (every expert loaded at each use): an empty fast tier
    assert plan_memory(memory_bytes=None, fast_tier_bytes=None, cached=False, **PARTS).fast_tier_bytes == 0


def test_the_resident_arena_takes_the_experts_out_of_the_cache_only_when_all_fit():
    whole = plan_memory(memory_bytes=None, fast_tier_bytes=None, arena_possible=True, **PARTS)
    assert whole.arena and whole.cache_bytes == 0 and whole.fast_tier_bytes == 5000
    part = plan_memory(memory_bytes=None, fast_tier_bytes=4999, arena_possible=True, **PARTS)
    assert not part.arena and part.cache_bytes == 4999


def test_a_plan_below_one_expert_names_its_minimum_and_both_flags_are_refused():
    minimum = 1000 + 300 + 200 + 400
    with pytest.raises(HexqError, match=f"below the minimum of .*\\({minimum} bytes\\)"):
        plan_memory(memory_bytes=minimum - 1, fast_tier_bytes=None, **PARTS)
    assert plan_memory(memory_bytes=minimum, fast_tier_bytes=None, **PARTS).fast_tier_bytes == 400
    with pytest.raises(HexqError, match="--fast-tier 399 B cannot hold one expert; the minimum is 400 B \\(400 bytes"):
        plan_memory(memory_bytes=None, fast_tier_bytes=399, **PARTS)
    with pytest.raises(HexqError, match="not both"):
        plan_memory(memory_bytes=10**6, fast_tier_bytes=10**3, **PARTS)


def test_the_slot_pools_stay_within_the_one_count(mixed_artifact):
    """Free slots of one width are given up when experts of another need the bytes: what the pools hold (free) plus
    what the count holds (in use) never exceeds the fast tier, as the cache drives it (reserve, load; recycle,
    release)."""
    artifact = Artifact(mixed_artifact)
    try:
        sizes = SlotSizes.of(artifact, "packed")
        stored = {bits: [(row, expert) for row in range(len(artifact.moe_layers))
                         for expert in range(artifact.num_experts) if bits in artifact.stored_bits(row, expert)]
                  for bits in sizes.slot_bytes}
        narrow, wide = min(stored, key=sizes.slot_bytes.get), max(stored, key=sizes.slot_bytes.get)
        small, large = sizes.slot_bytes[narrow], sizes.slot_bytes[wide]
        assert small < large
        tier = FastTier(2 * large)
        source = ArtifactSource(artifact, sizes, tier)

        def allocated() -> int:
            free = sum(size * len(slots) for size, slots in source._pools.items())
            return free + tier.used

        def fill(index: int, bits: int):
            assert tier.reserve(sizes.slot_bytes[bits])
            weights = source.load(*stored[bits][index], bits)
            assert allocated() <= tier.capacity
            return weights

        def free(weights) -> None:
            source.recycle(weights)  # the cache hands the slot back before it releases the bytes
            tier.release(weights.nbytes)

        count = tier.capacity // small
        narrow_ones = [fill(expert, narrow) for expert in range(count)]
        for weights in narrow_ones:
            free(weights)
        assert tier.used == 0 and allocated() == count * small > tier.capacity - large  # kept for reuse
        wide_ones = [fill(expert, wide) for expert in range(2)]  # needs every narrow slot given up
        assert tier.used == 2 * large and allocated() == 2 * large
        for weights in wide_ones:
            free(weights)
        fill(0, narrow)  # a wide slot goes so that a narrow one fits
        assert allocated() <= tier.capacity
    finally:
        artifact.close()
