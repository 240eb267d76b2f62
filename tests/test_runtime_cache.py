"""ExpertCache: 004 §4.4.2 mixed-precision LRU rules, 001 §3.2-3.3 versioned handles and budget, prefetch worker."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hexq.runtime.cache import ExpertCache
from hexq.runtime.residency import ExpertWeights, FastTier


def expected_value(layer: int, expert: int, bits: int) -> float:
    return float(layer * 1000 + expert * 10 + bits)


HIDDEN, WIDTH = 3, 2  # hidden size and expert width of the fake experts
GATE_UP, DOWN = (2 * WIDTH, HIDDEN), (HIDDEN, WIDTH)  # [2I, H] and [H, I]


class FakeSource:
    """Tiny float32 experts whose every element encodes (layer, expert, bits).

    As in the real source (hexq.runtime.engine.ArtifactSource), every width dequantizes to compute tensors of the
    same shape and dtype, so an expert takes the same bytes at every precision: a promotion changes what an entry
    holds, not how much room it takes, and the cache must count the old and the new copy while both exist."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.loads: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def nbytes(self, layer: int, expert: int, bits: int) -> int:
        return 4 * (GATE_UP[0] * GATE_UP[1] + DOWN[0] * DOWN[1])  # float32, whatever the bits

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        if self.delay:
            time.sleep(self.delay)
        v = expected_value(layer, expert, bits)
        with self._lock:
            self.loads.append((layer, expert, bits))
        return ExpertWeights(bits, torch.full(GATE_UP, v), torch.full(DOWN, v))


def assert_weights(w: ExpertWeights, layer: int, expert: int, min_bits: int) -> None:
    assert w.bits >= min_bits
    v = expected_value(layer, expert, w.bits)
    assert bool((w.gate_up == v).all()) and bool((w.down == v).all()), (layer, expert, w.bits)


NB = FakeSource().nbytes
N = NB(0, 0, 4)  # one expert at any width: 72 bytes
assert NB(0, 0, 2) == N == NB(0, 0, 8)


@pytest.fixture
def make_cache():
    caches = []

    def make(capacity: int, source: FakeSource | None = None) -> ExpertCache:
        cache = ExpertCache(source or FakeSource(), FastTier(capacity))
        caches.append(cache)
        return cache

    yield make
    for c in caches:
        c.close()


# ---------------------------------------------------------------- budget tracker


def test_fast_tier_admission_and_peak():
    b = FastTier(100)
    assert b.reserve(60) and b.used == 60
    assert not b.reserve(41)  # a failed reservation changes nothing
    assert b.used == 60 and b.peak == 60
    assert b.reserve(40) and b.used == 100 and b.available == 0
    b.release(70)
    assert b.used == 30 and b.peak == 100
    with pytest.raises(ValueError, match="exceeds"):
        b.release(31)
    with pytest.raises(ValueError):
        FastTier(-1)
    assert not FastTier(0).reserve(1)  # no cache: every reservation refused


def test_fast_tier_threads_never_exceed_capacity():
    b = FastTier(1000)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2000):
            n = rng.randint(1, 300)
            if b.reserve(n):
                b.release(n)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.used == 0 and 0 < b.peak <= 1000


# ---------------------------------------------------------------- 004 §4.4.2 rules


def test_hit_miss_promotion_and_conservative_reuse(make_cache):
    src = FakeSource()
    cache = make_cache(1000, src)
    assert_weights(cache.get(0, 1, 2), 0, 1, 2)  # cold miss
    assert_weights(cache.get(0, 1, 2), 0, 1, 2)  # hit
    v2 = cache.handle(0, 1).resolve()
    w4 = cache.get(0, 1, 4)  # low copy resident, high requested: a miss that promotes
    assert w4.bits == 4
    v4 = cache.handle(0, 1).resolve()
    assert v4.version == v2.version + 1 and v4.bits == 4
    assert cache.get(0, 1, 2) is w4  # low requested, high resident: reused without I/O
    s = cache.stats
    assert (s.hits, s.misses, s.promotions) == (2, 2, 1)
    assert s.layer_hits == {0: 2} and s.layer_misses == {0: 2}
    assert src.loads == [(0, 1, 2), (0, 1, 4)]
    # One copy per expert: the 2-bit version was released after the 4-bit one was published.
    assert cache.resident() == {(0, 1): 4}
    assert cache.fast_tier.used == N


def test_handle_is_stable_and_eviction_unpublishes(make_cache):
    cache = make_cache(N)
    h = cache.handle(0, 0)
    assert h.resolve() is None
    w = cache.get(0, 0, 4)
    assert cache.handle(0, 0) is h and h.resolve().weights is w
    cache.get(0, 1, 4)  # evicts (0, 0)
    assert h.resolve() is None
    assert_weights(w, 0, 0, 4)  # a reader holding the old object still has a complete version


def test_lru_eviction_order(make_cache):
    cache = make_cache(3 * N)
    for e in (0, 1, 2):
        cache.get(0, e, 4)
    cache.get(0, 0, 4)  # touch 0: order is now 1, 2, 0
    cache.get(0, 3, 4)  # evicts 1
    assert list(cache.resident()) == [(0, 2), (0, 0), (0, 3)]
    cache.get(0, 4, 4)  # evicts 2
    assert list(cache.resident()) == [(0, 0), (0, 3), (0, 4)]
    assert cache.stats.evictions == 2
    assert cache.fast_tier.peak <= cache.fast_tier.capacity


def test_watchers_hear_of_every_eviction_and_promotion_and_touch_counts_hits(make_cache):
    """What the native step relies on (hexq.runtime.native): a watcher is told, before the memory can be reused, of
    every key whose published weights stop being valid - an LRU eviction and a promotion that replaces them, not a hit
    or a fill of another key; touch() counts the hits the caller served itself and refreshes their recency, so
    the LRU evicts what was least used, not what the cache last saw asked for."""
    cache = make_cache(3 * N)
    gone = []
    cache.watch(gone.append)
    for e in (0, 1, 2):
        cache.get(0, e, 2)
    cache.get(0, 0, 2)  # a hit: nothing gone
    assert gone == []
    cache.touch([(0, 1), (0, 9)])  # order now 2, 0, 1; a key not resident is ignored
    assert cache.stats.hits == 2 and cache.stats.layer_hits == {0: 2}
    cache.get(0, 3, 2)  # evicts the least recently used: 2 (not 1, which touch refreshed)
    assert gone == [(0, 2)] and (0, 1) in cache.resident()
    cache.get(0, 1, 4)  # a promotion: the 2-bit weights of (0, 1) are replaced
    assert gone[1:] == [(0, 0), (0, 1)]  # room for the second copy (evicts 0), then the replaced version
    assert cache.resident()[(0, 1)] == 4


def test_a_fill_without_admission_never_asks_the_cost_model():
    asked = []
    cache = ExpertCache(FakeSource(), FastTier(2 * N), lambda *args: asked.append(args) or False)
    try:
        cache.get(0, 0, 4)
        cache.get(0, 1, 4)
        assert not cache.get(0, 2, 4, admit=False).transient and asked == []  # filled, evicting 0
        assert (0, 2) in cache.resident() and cache.stats.admission_declined == 0
        cache.get(0, 3, 4)  # asked, declined: a bypass load, nothing evicted
        assert len(asked) == 1 and cache.stats.bypass_loads == 1 and (0, 3) not in cache.resident()
    finally:
        cache.close()


def test_pinned_entries_are_not_evicted(make_cache):
    src = FakeSource()
    cache = make_cache(2 * N, src)
    with cache.pinned(0, [0, 1]):
        cache.get(0, 0, 4)
        cache.get(0, 1, 4)
        w = cache.get(0, 2, 4)  # no unpinned room: served by a transient bypass load, not cached
        assert_weights(w, 0, 2, 4)
        assert set(cache.resident()) == {(0, 0), (0, 1)}
        assert cache.stats.bypass_loads == 1
        cache.prefetch(0, 3, 4)  # may not evict pinned entries: dropped
        cache.wait_idle()
        assert cache.stats.prefetch_dropped == 1
        assert set(cache.resident()) == {(0, 0), (0, 1)}
    cache.get(0, 2, 4)  # unpinned now: (0, 0) is the LRU victim
    assert list(cache.resident()) == [(0, 1), (0, 2)]
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin(0, [1])


def test_bytes_moved_is_sum_of_loaded_nbytes(make_cache):
    src = FakeSource()
    cache = make_cache(2 * N, src)
    rng = random.Random(0)
    for _ in range(60):
        cache.get(rng.randrange(2), rng.randrange(4), rng.choice([2, 4, 8]), fill=rng.random() < 0.8)
    assert cache.stats.bytes_moved == sum(NB(*k) for k in src.loads)
    assert cache.stats.misses == len(src.loads)


def test_fill_false_reuses_resident_copy_and_does_not_cache(make_cache):
    src = FakeSource()
    cache = make_cache(1000, src)
    cache.get(0, 0, 4)
    assert cache.get(0, 0, 2, fill=False).bits == 4  # hit: no I/O
    w = cache.get(0, 1, 2, fill=False)
    assert_weights(w, 0, 1, 2)
    assert (0, 1) not in cache.resident()
    assert src.loads == [(0, 0, 4), (0, 1, 2)] and cache.stats.bypass_loads == 1


# ---------------------------------------------------------------- promotion accounting


class GatedSource(FakeSource):
    """Loads of the listed (layer, expert, bits) block until `gate` is set."""

    def __init__(self, gated: set[tuple[int, int, int]]):
        super().__init__()
        self.gated = gated
        self.gate = threading.Event()
        self.started = threading.Event()

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        if (layer, expert, bits) in self.gated:
            self.started.set()
            assert self.gate.wait(5)
        return super().load(layer, expert, bits)


def test_promotion_counts_both_versions_and_keeps_old_readable(make_cache):
    src = GatedSource({(0, 0, 8)})
    cache = make_cache(2 * N, src)
    cache.get(0, 0, 2)
    cache.prefetch(0, 0, 8)  # background promotion
    assert src.started.wait(5)
    # During the load the 2-bit version stays published: readers of <= 2 bits hit without waiting.
    assert cache.get(0, 0, 2).bits == 2
    assert cache.fast_tier.used == 2 * N  # both versions counted
    src.gate.set()
    cache.wait_idle()
    assert cache.resident() == {(0, 0): 8}
    assert cache.fast_tier.used == N
    assert cache.fast_tier.peak == 2 * N <= cache.fast_tier.capacity
    assert cache.stats.promotions == 1


def test_promotion_makes_room_for_a_second_copy_by_evicting_others(make_cache):
    src = FakeSource()
    cache = make_cache(2 * N, src)  # two experts, or one expert during its promotion
    cache.get(0, 0, 2)
    cache.get(0, 1, 4)
    cache.prefetch(0, 0, 8)  # old and new copy of (0, 0) need 2 N: (0, 1) is evicted, the 2-bit copy stays readable
    cache.wait_idle()
    assert cache.resident() == {(0, 0): 8}
    assert (cache.stats.promotions, cache.stats.evictions) == (1, 1)
    assert cache.fast_tier.used == N and cache.fast_tier.peak == 2 * N


def test_promotion_next_to_a_pinned_expert_frees_first_or_drops(make_cache):
    src = FakeSource()
    cache = make_cache(2 * N, src)
    cache.get(0, 0, 2)
    cache.get(0, 1, 4)
    with cache.pinned(0, [1]):  # no room for a second copy of (0, 0) without touching the pinned expert
        cache.prefetch(0, 0, 8)
        cache.wait_idle()
        assert cache.stats.prefetch_dropped == 1 and cache.resident() == {(0, 0): 2, (0, 1): 4}
        assert cache.get(0, 0, 8).bits == 8  # a blocking get retires the 2-bit copy first
    assert cache.resident() == {(0, 1): 4, (0, 0): 8}
    assert (cache.stats.promotions, cache.stats.evictions) == (1, 0)
    assert cache.fast_tier.used == cache.fast_tier.peak == 2 * N


def test_promotion_frees_first_when_both_cannot_fit(make_cache):
    src = FakeSource()
    cache = make_cache(N, src)
    cache.get(0, 0, 2)
    cache.prefetch(0, 0, 8)  # background work never makes an expert unavailable: dropped
    cache.wait_idle()
    assert cache.resident() == {(0, 0): 2} and cache.stats.prefetch_dropped == 1
    assert cache.get(0, 0, 8).bits == 8  # a blocking get retires the 2-bit copy first
    assert cache.resident() == {(0, 0): 8}
    assert cache.fast_tier.peak == N
    assert cache.stats.promotions == 1 and cache.stats.evictions == 0


# ---------------------------------------------------------------- prefetch


def test_get_waits_for_inflight_prefetch_instead_of_loading_twice(make_cache):
    src = GatedSource({(1, 3, 4)})
    cache = make_cache(1000, src)
    cache.prefetch(1, 3, 4)
    assert src.started.wait(5)
    threading.Timer(0.05, src.gate.set).start()
    w = cache.get(1, 3, 4)
    assert_weights(w, 1, 3, 4)
    assert src.loads == [(1, 3, 4)]
    s = cache.stats
    assert (s.hits, s.misses, s.prefetch_issued, s.prefetch_used) == (1, 0, 1, 1)
    assert s.wait_seconds >= 0.04
    cache.prefetch(1, 3, 2)  # already resident at higher precision
    assert cache.stats.prefetch_skipped == 1


def test_prefetch_then_get_is_a_hit(make_cache):
    src = FakeSource()
    cache = make_cache(1000, src)
    for e in range(3):
        cache.prefetch(2, e, 4)
    cache.wait_idle()
    for e in range(3):
        assert_weights(cache.get(2, e, 4), 2, e, 4)
    s = cache.stats
    assert (s.hits, s.misses, s.prefetch_used, s.wait_seconds) == (3, 0, 3, 0.0)
    assert len(src.loads) == 3


def test_failed_load_releases_its_reservation(make_cache):
    class Broken(FakeSource):
        def load(self, layer, expert, bits):
            if expert == 9:
                raise OSError("bad shard")
            return super().load(layer, expert, bits)

    cache = make_cache(1000, Broken())
    with pytest.raises(OSError):
        cache.get(0, 9, 4)
    cache.prefetch(0, 9, 4)
    with pytest.raises(OSError, match="bad shard"):  # the worker's failure reaches the caller, once
        cache.wait_idle()
    cache.wait_idle()
    assert cache.fast_tier.used == 0 and cache.stats.prefetch_dropped == 1
    assert_weights(cache.get(0, 1, 4), 0, 1, 4)  # the worker survived and the cache still works
    cache.prefetch(0, 2, 4)  # but loads nothing more in the background after a failure
    cache.wait_idle()
    assert cache.stats.prefetch_dropped == 2 and (0, 2) not in cache.resident()


def test_source_size_mismatch_is_reported(make_cache):
    class Liar(FakeSource):
        def nbytes(self, layer, expert, bits):
            return super().nbytes(layer, expert, bits) - 4

    cache = make_cache(1000, Liar())
    with pytest.raises(ValueError, match="nbytes"):
        cache.get(0, 0, 4)
    assert cache.fast_tier.used == 0


def test_close_stops_worker_and_frees_everything():
    cache = ExpertCache(FakeSource(), FastTier(1000))
    cache.get(0, 0, 4)
    cache.close()
    assert cache.fast_tier.used == 0 and not cache._worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        cache.get(0, 0, 4)
    with pytest.raises(RuntimeError, match="closed"):
        cache.prefetch(0, 0, 4)
    cache.close()  # idempotent


# ---------------------------------------------------------------- too small


def test_capacity_smaller_than_one_expert_raises_with_minimum(make_cache):
    cache = make_cache(N - 1)
    with pytest.raises(ValueError, match=f"minimum budget is {N} bytes"):
        cache.get(0, 0, 8)
    assert_weights(cache.get(0, 0, 8, fill=False), 0, 0, 8)  # the bypass path still computes
    cache.prefetch(0, 0, 8)
    cache.wait_idle()
    assert cache.stats.prefetch_dropped == 1 and cache.fast_tier.peak == 0


# ---------------------------------------------------------------- concurrency


class PiecewiseSource(FakeSource):
    """Writes each tensor in pieces with sleeps in between, as a slow unpack/dequantize would."""

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        v = expected_value(layer, expert, bits)
        gate_up, down = torch.full(GATE_UP, -1.0), torch.full(DOWN, -1.0)
        for row in range(GATE_UP[0]):
            gate_up[row] = v
            time.sleep(0.002)
        for row in range(DOWN[0]):
            down[row] = v
            time.sleep(0.002)
        with self._lock:
            self.loads.append((layer, expert, bits))
        return ExpertWeights(bits, gate_up, down)


def test_slow_loader_never_exposes_a_partial_version(make_cache):
    src = PiecewiseSource()
    # Room for two copies: a promotion of (0, 0) fits, and so does (0, 0) next to one other expert; two other
    # experts pinned at once force (0, 0) out.
    cache = make_cache(2 * N, src)
    stop = threading.Event()
    seen: list[tuple[int, int]] = []  # (version, bits) of (0, 0) as the reader observed them, in order
    errors: list[str] = []

    def complete(w: ExpertWeights) -> bool:
        v = expected_value(0, 0, w.bits)
        return bool((w.gate_up == v).all()) and bool((w.down == v).all())

    def reader() -> None:
        h = cache.handle(0, 0)
        while not stop.is_set():
            v = h.resolve()  # lock-free path
            if v is not None:
                if not complete(v.weights):
                    errors.append(f"partial version {v.version} at {v.bits} bits")
                if not seen or seen[-1] != (v.version, v.bits):
                    seen.append((v.version, v.bits))
            if not complete(cache.get(0, 0, 2)):  # hits the old version during a promotion, or reloads it
                errors.append("get returned a partial version")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(3):
            deadline = time.monotonic() + 5
            while cache.resident().get((0, 0)) != 2 and time.monotonic() < deadline:
                time.sleep(0.001)  # the reader has (re)loaded and published the 2-bit version
            while cache.resident().get((0, 0)) != 8 and time.monotonic() < deadline:
                # Background promotion while the reader keeps using the 2-bit version. It is dropped if the reader
                # is reloading the 2-bit version at that moment, hence the retry.
                cache.prefetch(0, 0, 8)
                cache.wait_idle()
            promoted = cache.handle(0, 0).resolve()
            while not (seen and promoted and seen[-1][0] >= promoted.version) and time.monotonic() < deadline:
                time.sleep(0.001)  # let the reader see the promoted version before it is evicted
            with cache.pinned(0, [1, 2]):  # evicts (0, 0) at 8 bits; the reader reloads it at 2 bits
                cache.get(0, 1, 8)
                cache.get(0, 2, 8)
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:3]
    assert seen == sorted(seen)  # a handle's versions only move forward
    assert {bits for _, bits in seen} == {2, 8} and len(seen) >= 4
    assert cache.stats.promotions >= 1
    assert cache.fast_tier.peak <= cache.fast_tier.capacity


def test_stress_random_requests_with_concurrent_prefetch(make_cache):
    src = FakeSource(delay=0.0002)
    capacity = 3 * N  # three of the 18 experts: constant pressure
    cache = make_cache(capacity, src)
    layers, experts, widths = 3, 6, (2, 4, 8)
    errors: list[str] = []
    over_budget = threading.Event()
    stop = threading.Event()

    def watch_budget() -> None:
        while not stop.is_set():
            if cache.fast_tier.used > capacity:
                over_budget.set()
            time.sleep(0.0005)

    def second_reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            layer, expert, bits = rng.randrange(layers), rng.randrange(experts), rng.choice(widths)
            w = cache.get(layer, expert, bits)
            if w.bits < bits or not bool((w.gate_up == expected_value(layer, expert, w.bits)).all()):
                errors.append(f"reader got {w.bits} bits for {(layer, expert, bits)}")

    helpers = [threading.Thread(target=watch_budget), threading.Thread(target=second_reader, args=(1,))]
    for t in helpers:
        t.start()
    rng = random.Random(0)
    try:
        for step in range(1200):
            layer = step % layers
            chosen = rng.sample(range(experts), 2)
            bits = {e: rng.choice(widths) for e in chosen}
            nxt = (layer + 1) % layers
            for e in rng.sample(range(experts), 2):  # look-ahead for the next layer (004 §4.4.1)
                cache.prefetch(nxt, e, rng.choice(widths))
            with cache.pinned(layer, chosen):
                for e in chosen:
                    w = cache.get(layer, e, bits[e], fill=rng.random() < 0.9)
                    assert_weights(w, layer, e, bits[e])
    finally:
        stop.set()
        for t in helpers:
            t.join()
    cache.wait_idle()
    assert not errors, errors[:3]
    assert not over_budget.is_set()
    assert cache.fast_tier.peak <= capacity
    # Accounting closes: what is reserved is exactly what is published, and every load was counted once.
    assert cache.fast_tier.used == N * len(cache.resident())
    s = cache.stats
    assert s.bytes_moved == sum(NB(*k) for k in src.loads)
    assert s.prefetch_issued == 2 * 1200
    assert s.hits > 0 and s.promotions > 0 and s.evictions > 0 and s.prefetch_used > 0


# ---------------------------------------------------------------- admission, recycling, deferred frees


class RecyclingSource(FakeSource):
    """Records every version handed back, as a slot pool would."""

    def __init__(self):
        super().__init__()
        self.recycled: list[ExpertWeights] = []
        self.transient: list[tuple[int, int, int]] = []

    def recycle(self, weights):
        self.recycled.append(weights)

    def load_transient(self, layer, expert, bits):
        self.transient.append((layer, expert, bits))
        return super().load(layer, expert, bits)


def test_admission_sees_the_victims_and_a_declined_fill_is_a_transient_load():
    asked = []

    def admission(key, bits, victims, prefetch):
        asked.append((key, bits, victims, prefetch))
        return key[1] != 7  # expert 7 is never worth an eviction

    source = RecyclingSource()
    cache = ExpertCache(source, FastTier(2 * N), admission)
    try:
        cache.get(0, 0, 4)
        cache.get(0, 1, 2)
        assert asked == []  # free room: nothing to decide
        assert_weights(cache.get(0, 7, 4), 0, 7, 4)
        assert asked == [((0, 7), 4, [((0, 0), 4)], False)]  # the least recently used entry would go
        assert cache.resident() == {(0, 0): 4, (0, 1): 2} and source.transient == [(0, 7, 4)]
        stats = cache.stats
        assert stats.admission_declined == 1 and stats.bypass_loads == 1 and stats.evictions == 0
        cache.get(0, 3, 4)  # admitted: evicts the LRU entry, whose version goes back to the source
        assert cache.resident() == {(0, 1): 2, (0, 3): 4}
        assert [w.gate_up[0, 0].item() for w in source.recycled] == [expected_value(0, 0, 4)]
        cache.prefetch(0, 7, 4)
        cache.wait_idle()
        assert asked[-1][3] is True and (0, 7) not in cache.resident()  # prefetches are asked too, then dropped
    finally:
        cache.close()
    assert len(source.recycled) == 3  # close hands back what was resident


def test_a_version_replaced_while_pinned_is_freed_at_the_last_unpin():
    source = RecyclingSource()
    cache = ExpertCache(source, FastTier(3 * N))
    try:
        with cache.pinned(0, [5]):
            low = cache.get(0, 5, 2)
            cache.prefetch(0, 5, 4)  # promoted in the background while the 2-bit copy is in use
            cache.wait_idle()
            assert cache.resident() == {(0, 5): 4}
            assert source.recycled == [] and cache.fast_tier.used == 2 * N  # still counted, memory untouched
            assert_weights(low, 0, 5, 2)
        assert [w.bits for w in source.recycled] == [2] and cache.fast_tier.used == N
    finally:
        cache.close()
