"""Budgeted mixed-precision expert cache: versioned handles, admission control and a background prefetch worker.

Papers: 001 §3.2-3.4 (DynaExq: versioned expert residency, a budget tracker with admission control, transitions
on a separate worker so the forward pass never waits on them) and 004 §4.4 (DyMoE: look-ahead prefetch and the
mixed-precision LRU rules).

Tiers and versioned residency: hexq.runtime.residency. The prefetch worker: hexq.runtime.cache_prefetch.

Mixed-precision LRU (004 §4.4.2), for a request of b bits:
  - one copy per expert (no duplication);
  - a resident copy with bits >= b is a hit and is returned as is (conservative reuse: 8 bits serve a 4-bit ask);
  - a resident copy with bits < b is a miss that promotes: the b-bit version is loaded and replaces it;
  - room is made by evicting least-recently-used entries that are not pinned.

Promotion accounting. A promotion reserves the new version's bytes while the old version stays published and
counted, and the old bytes are released only after the new version is published ("count both", 001's publish then
free): concurrent readers asking for <= old bits keep hitting during the load. Only when old + new cannot fit even
after evicting every other unpinned entry does a *blocking* `get` fall back to "free first": the old version is
unpublished and released, then the new one reserved; readers of that expert wait for the fill meanwhile.
A background prefetch never frees first: it is dropped instead, so background work never makes an expert
unavailable.

Pins and references. `pin`/`pinned` protect the experts the current layer computes with: pinned entries are never
evicted (refcounted, so overlapping pins compose), and prefetches may not evict them. This is what keeps memory
accounted under a running compute: pin the layer's experts, compute, unpin. A version replaced by a promotion while
its expert is pinned stays counted (and its memory untouched) until the last unpin. Hold a pin while using weights:
with a source that recycles memory, an evicted version's memory is reused by the next fill.

Bypass and admission. `get(..., fill=False)` returns a resident copy when there is one and otherwise loads the
expert without caching it; `get` also takes this path when no room can be made (everything resident is pinned), or
when a fill would have to evict and the `admission` callback (the runtime's per-miss cost model,
hexq.runtime.cost) declines: admission(key, bits, victims, prefetch) sees the entries the fill would evict, least
recently used first. A bypass buffer is transient scratch outside the cache budget: whoever sizes the runtime
reserves one expert of scratch for it (hexq.runtime.source counts it in its scratch). An expert larger than the whole
capacity cannot be cached: `get(..., fill=True)` raises a HexqError that states the minimum budget.

Errors of the prefetch worker. A failed background load (a corrupt shard, a read error) is not logged as a
traceback: the first one is kept, the worker stops loading, and the next `get`, `prefetch` or `wait_idle` of the
forward pass raises it, once, as the caller's own error (with HEXQ_DEBUG=1 the CLI shows its traceback, the worker's
frames included). Later failures are only counted (prefetch_dropped).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from hexq.base.errors import HexqError
from hexq.runtime.cache_prefetch import PrefetchWorker
from hexq.runtime.residency import (
    Admission,
    CacheStats,
    ExpertHandle,
    ExpertSource,
    ExpertVersion,
    ExpertWeights,
    FastTier,
    Key,
)

logger = logging.getLogger(__name__)

class ExpertCache(PrefetchWorker):
    """Mixed-precision LRU expert cache under a hard byte budget, with a background prefetch worker.

    get(layer, expert, bits) blocks and returns weights with >= bits; prefetch(...) queues a non-blocking fill for
    the worker thread; pin/unpin/pinned protect the current layer's experts from eviction; close() stops the worker
    and frees everything. All public methods are thread-safe. See the module docstring for the rules.
    """

    def __init__(self, source: ExpertSource, fast_tier: FastTier, admission: Admission | None = None):
        self._source = source
        self._admission = admission
        self._recycle = getattr(source, "recycle", None)
        self._load_transient = getattr(source, "load_transient", None) or source.load
        self._deferred: dict[Key, list[ExpertVersion]] = {}  # replaced while pinned: freed at the last unpin
        self._error: BaseException | None = None  # the prefetch worker's first failure, raised once by the caller
        self._error_raised = False
        self._fast_tier = fast_tier
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on every publish, failed load, unpin and close
        self._handles: dict[Key, ExpertHandle] = {}
        self._lru: OrderedDict[Key, ExpertHandle] = OrderedDict()  # published entries, least recently used first
        self._inflight: dict[Key, int] = {}  # key -> bits being loaded (its bytes are already reserved)
        self._prefetched: set[Key] = set()  # filled by prefetch and not hit yet
        self._pins: Counter[Key] = Counter()
        self._queued: dict[Key, int] = {}  # prefetch requests waiting for the worker: key -> bits
        self._stats = CacheStats()
        self._watchers: list[Callable[[Key], None]] = []  # told when a key's published weights go (watch)
        self._closed = False
        self._queue: queue.Queue[Key | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="hexq-expert-prefetch", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- inspection

    @property
    def fast_tier(self) -> FastTier:
        return self._fast_tier

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            s = self._stats
            return replace(s, layer_hits=dict(s.layer_hits), layer_misses=dict(s.layer_misses))

    def reset_stats(self) -> None:
        """Start the counters afresh (e.g. after a warm start); what is resident stays, no longer marked prefetched."""
        with self._lock:
            self._stats = CacheStats()
            self._prefetched.clear()

    def handle(self, layer: int, expert: int) -> ExpertHandle:
        """The stable handle of (layer, expert); the same object for the cache's lifetime."""
        with self._lock:
            return self._handle((layer, expert))

    def resident(self) -> dict[Key, int]:
        """Published entries as {(layer, expert): bits}, least recently used first."""
        with self._lock:
            return {k: h._active.bits for k, h in self._lru.items() if h._active is not None}

    def watch(self, gone: Callable[[Key], None]) -> None:
        """Call gone(key), under the cache's lock, whenever the weights published for `key` stop being valid: an
        eviction, or a promotion that replaces them (their memory is then recycled). A reader that keeps pointers to
        resident weights outside the cache's calls (the native decode step's expert tables) drops them there."""
        with self._lock:
            self._watchers.append(gone)

    def touch(self, keys: Iterable[Key]) -> None:
        """Count hits the caller served from resident weights it already held (the native step), and mark those
        entries most recently used, as `get` would have."""
        with self._lock:
            for key in keys:
                if key in self._lru:
                    self._lru.move_to_end(key)
                    self._record(key, hit=True)

    # ---------------------------------------------------------------- pins

    def pin(self, layer: int, experts: Iterable[int]) -> None:
        """Protect (layer, e) for e in experts from eviction until unpinned (refcounted)."""
        with self._lock:
            for e in experts:
                self._pins[(layer, e)] += 1

    def unpin(self, layer: int, experts: Iterable[int]) -> None:
        with self._lock:
            for e in experts:
                key = (layer, e)
                if self._pins[key] <= 0:
                    raise ValueError(f"expert {key} is not pinned")
                self._pins[key] -= 1
                if self._pins[key] == 0:
                    del self._pins[key]
                    for old in self._deferred.pop(key, ()):
                        self._free(old)
            self._changed.notify_all()

    @contextmanager
    def pinned(self, layer: int, experts: Iterable[int]) -> Iterator[None]:
        """Pin the experts a layer computes with for the duration of the block."""
        experts = list(experts)
        self.pin(layer, experts)
        try:
            yield
        finally:
            self.unpin(layer, experts)

    def relayout(self, layer: int, expert: int, change: Callable[[ExpertWeights], ExpertWeights]) -> ExpertWeights:
        """Republish a pinned resident expert as change(weights): the same slot and bytes, re-laid in place for the
        CPU kernels (hexq.packed.cpu.CpuKernels.relayout), so every later reader gets the new layout; the slot and its
        accounting stay. Under the cache's lock: no reader sees the bytes half re-laid."""
        key = (layer, expert)
        with self._lock:
            handle = self._handle(key)
            version = handle.resolve()
            if version is None or self._pins[key] <= 0:
                raise ValueError(f"expert {key} is not pinned and resident")
            weights = change(version.weights)
            handle._publish(weights, version.nbytes)
            return weights

    # ---------------------------------------------------------------- get

    def get(self, layer: int, expert: int, bits: int, *, fill: bool = True, admit: bool = True) -> ExpertWeights:
        """Weights of (layer, expert) with at least `bits` bits; blocks until they are available.

        A load of the same expert already in flight (e.g. a prefetch) is waited for, never repeated. With fill=False
        a miss is served by a transient bypass load that is not cached (see the module docstring); admit=False skips
        the admission callback (a miss fills whenever room can be made).
        """
        key = (layer, expert)
        waited = 0.0
        with self._lock:
            self._check_open()
            self._raise_worker_error()
            while True:
                version = self._hit_version(key, bits)
                if version is not None:
                    self._record(key, hit=True)
                    self._stats.wait_seconds += waited
                    if key in self._prefetched:
                        self._prefetched.discard(key)
                        self._stats.prefetch_used += 1
                    return version.weights
                if key in self._inflight:  # same expert on its way: wait instead of loading twice
                    waited += self._wait()
                    continue
                need = self._source.nbytes(layer, expert, bits)
                if not fill:
                    break
                self._check_fits(key, bits, need)
                promoting = key in self._lru  # before _admit, which may retire the old copy first
                admitted = self._admit(key, bits, need, background=False, admit=admit)
                if admitted:
                    self._start_fill(key, bits, promoting)
                    self._record(key, hit=False)
                    break
                if admitted is None:  # the cost model prefers a transient load to evicting what is resident
                    fill = False
                    break
                if self._inflight:  # other loads hold reservations; once published they may be evictable
                    waited += self._wait()
                    continue
                logger.debug("no room for expert %s at %d bits (all resident entries pinned): bypass", key, bits)
                fill = False
                break
            if not fill:
                self._stats.bypass_loads += 1
                self._record(key, hit=False)
        t0 = time.perf_counter()
        try:
            if fill:
                return self._fill(key, bits, need, prefetched=False)
            return self._load(key, bits, need, transient=True)
        finally:
            with self._lock:
                self._stats.wait_seconds += waited + time.perf_counter() - t0

    def close(self) -> None:
        """Stop the worker (queued prefetches are dropped), then unpublish and release every entry."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stats.prefetch_dropped += len(self._queued)
            self._queued.clear()
            self._changed.notify_all()
        self._queue.put(None)
        self._worker.join()
        with self._lock:
            for key in list(self._lru):
                self._retire(key)

    def __enter__(self) -> ExpertCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- internals (caller holds self._lock)

    def _handle(self, key: Key) -> ExpertHandle:
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = ExpertHandle(*key)
        return h

    def _hit_version(self, key: Key, bits: int) -> ExpertVersion | None:
        """The published version of `key` if it has >= bits, marked most recently used.

        Prefetch requests refresh recency too: a predicted expert should not be the next eviction victim.
        """
        h = self._lru.get(key)
        v = h.resolve() if h is not None else None
        if v is None or v.bits < bits:
            return None
        self._lru.move_to_end(key)
        return v

    def _record(self, key: Key, *, hit: bool) -> None:
        layer = key[0]
        if hit:
            self._stats.hits += 1
            self._stats.layer_hits[layer] = self._stats.layer_hits.get(layer, 0) + 1
        else:
            self._stats.misses += 1
            self._stats.layer_misses[layer] = self._stats.layer_misses.get(layer, 0) + 1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ExpertCache is closed")

    def _raise_worker_error(self) -> None:
        """Raise the prefetch worker's first failure in the calling thread, once."""
        if self._error is not None and not self._error_raised:
            self._error_raised = True
            raise self._error

    def _check_fits(self, key: Key, bits: int, need: int) -> None:
        if need > self._fast_tier.capacity:
            raise HexqError(
                f"expert cache capacity {self._fast_tier.capacity} bytes cannot hold expert (layer {key[0]}, expert "
                f"{key[1]}) at {bits} bits, which needs {need} bytes; the minimum budget is {need} bytes "
                f"({need / 2**20:.2f} MiB). Raise the budget, lower the precision, or compute it from a transient "
                "bypass buffer with get(..., fill=False)")

    def _wait(self) -> float:
        t0 = time.perf_counter()
        # The timeout is only a safety net: every state change notifies, and callers re-check state in a loop.
        self._changed.wait(timeout=1.0)
        if self._closed:
            raise RuntimeError("ExpertCache was closed while waiting")
        return time.perf_counter() - t0

    def _admit(self, key: Key, bits: int, need: int, *, background: bool, admit: bool = True) -> bool | None:
        """Reserve `need` bytes for a fill of `key`, evicting unpinned LRU entries; evicts nothing if it fails.

        A resident lower-precision copy of `key` stays published and counted ("count both"). Only a blocking get
        may retire it first when both cannot fit. Returns True (reserved), False (no room can be made) or None (room
        could be made, but the admission callback declined the evictions it takes).
        """
        if self._fast_tier.reserve(need):
            return True
        old = self._lru.get(key)
        old_version = old.resolve() if old is not None else None
        evicted, freed = self._victims(key, need, self._fast_tier.available)
        free_first = False
        if freed < need:  # evicting every unpinned entry would not make room
            if background or old_version is None or freed + old_version.nbytes < need:
                return False
            free_first = True
            evicted, freed = self._victims(key, need, self._fast_tier.available + old_version.nbytes)
        if self._admission is not None and admit and evicted:
            chosen = [(k, self._lru[k]._active.bits) for k in evicted]
            if not self._admission(key, bits, chosen, background):
                self._stats.admission_declined += 1
                return None
        if free_first:
            self._retire(key)  # free first: old + new cannot coexist within the capacity
        for victim in evicted:
            self._retire(victim)
            self._stats.evictions += 1
        if self._fast_tier.reserve(need):
            return True
        raise RuntimeError("admission arithmetic disagrees with the budget tracker")

    def _victims(self, key: Key, need: int, freed: int) -> tuple[list[Key], int]:
        """The least recently used unpinned entries other than `key` whose eviction brings `freed` bytes up to
        `need` (all of them if that is not enough), and the bytes then free. It stops as soon as there is room: a
        miss costs what it evicts, not a walk over everything resident."""
        evicted = []
        for victim, handle in self._lru.items():
            if freed >= need:
                break
            if victim != key and self._pins[victim] == 0:
                evicted.append(victim)
                freed += handle._active.nbytes
        return evicted, freed

    def _retire(self, key: Key) -> None:
        """Evict: redirect the handle to nothing first, then return the bytes to the budget."""
        handle = self._lru.pop(key)
        self._prefetched.discard(key)
        self._tell_gone(key)
        old = handle._unpublish()
        if old is not None:
            self._free(old)

    def _tell_gone(self, key: Key) -> None:
        for gone in self._watchers:
            gone(key)

    def _free(self, version: ExpertVersion) -> None:
        """Return a version no longer published: its memory to the source, then its bytes to the fast tier (in this
        order, so that the source never sees bytes released whose slot it does not hold yet)."""
        if self._recycle is not None:
            self._recycle(version.weights)
        self._fast_tier.release(version.nbytes)

    def _start_fill(self, key: Key, bits: int, promoting: bool) -> None:
        self._inflight[key] = bits
        if promoting:
            self._stats.promotions += 1

    # ---------------------------------------------------------------- loads (called without the lock)

    def _load(self, key: Key, bits: int, need: int, transient: bool = False) -> ExpertWeights:
        """Load from the source and check it against the size that was reserved."""
        t0 = time.perf_counter()
        weights = (self._load_transient if transient else self._source.load)(key[0], key[1], bits)
        elapsed = time.perf_counter() - t0
        if weights.bits != bits or not transient and weights.nbytes != need:
            if not transient and self._recycle is not None:
                self._recycle(weights)
            raise ValueError(f"source returned {weights.bits} bits / {weights.nbytes} bytes for expert {key} at "
                             f"{bits} bits, but its nbytes() said {need}; the cache budget relies on them agreeing")
        with self._lock:
            self._stats.bytes_moved += need
            self._stats.load_seconds += elapsed
        return weights

    def _fill(self, key: Key, bits: int, need: int, *, prefetched: bool) -> ExpertWeights:
        """Load into the `need` bytes already reserved for `key`, then publish; release the reservation on error."""
        try:
            weights = self._load(key, bits, need)
        except BaseException:
            with self._lock:
                self._fast_tier.release(need)
                del self._inflight[key]
                self._changed.notify_all()
            raise
        with self._lock:
            del self._inflight[key]
            self._changed.notify_all()
            if self._closed:  # closed during the load: hand the weights to this caller but do not keep them
                self._fast_tier.release(need)
                return weights
            handle = self._handle(key)
            old = handle.resolve()  # a lower-precision copy being promoted, still published and counted
            handle._publish(weights, need)
            self._lru.pop(key, None)
            self._lru[key] = handle  # most recently used
            if old is not None:  # publish, then free the replaced version (after the last unpin if in use)
                self._tell_gone(key)
                if self._pins[key]:
                    self._deferred.setdefault(key, []).append(old)
                else:
                    self._free(old)
            if prefetched:
                self._prefetched.add(key)
            else:
                self._prefetched.discard(key)
            return weights
