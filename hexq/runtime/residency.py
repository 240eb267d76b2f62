"""What the expert cache keeps and counts (hexq.runtime.cache has the rules): the weights of one expert at one
precision, the slow tier they come from, the fast tier's byte count, versioned handles (001 §3.2) and the counters.

Tiers. The slow tier is an `ExpertSource` (the packed artifact): `load` reads one expert at one precision into
`ExpertWeights` (its packed codes, or matrices expanded from them). The fast tier is the cache: at most
the memory plan's fast_tier_bytes of ExpertWeights (hexq.runtime.memory), counted by one `FastTier`. Every fill
reserves its bytes *before* it loads, so the counted bytes never exceed the capacity, not even while a load is in
flight. The fast tier is one pool shared by all precisions, because 004's LRU ranks experts of every precision
against each other. A source may own the memory its weights live in (hexq.runtime.source.ArtifactSource: slots
allocated once and reused, sized against the same FastTier): the cache then hands every version it stops counting
back through `source.recycle(weights)` before it releases the bytes, and transient loads go through
`source.load_transient` (a buffer the source reuses, valid until the same thread's next transient load).

Versioned residency (001 §3.2). Each (layer, expert) has one stable `ExpertHandle` that points to its published
`ExpertVersion` (bits, weights, version number) or to nothing. A version is built only from the object `load`
returned, i.e. after the load has finished, and the handle is switched in one reference assignment: a reader sees
the old complete version or the new complete version, never a partial one. Published tensors are never written
again. Eviction redirects first (the handle is unpublished) and frees the bytes second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hexq.base.errors import HexqError

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class ExpertWeights:
    """One expert at one precision as the fast tier holds it: gate_up [2I, H] and down [H, I], either packed
    (hexq.artifact.format.PackedWeight: codes, scale, zero) or expanded into float tensors. `slot` is the memory
    they live in (the source's, given back through recycle); `transient` marks a bypass load in the loading
    thread's reusable buffer, valid until that thread's next bypass load."""

    bits: int
    gate_up: object
    down: object
    slot: torch.Tensor | None = None
    transient: bool = False

    @property
    def packed(self) -> bool:
        return not isinstance(self.gate_up, torch.Tensor)

    @property
    def nbytes(self) -> int:
        """The memory they take: their slot's bytes, or the bytes of their tensors without one."""
        if self.slot is not None:
            return self.slot.numel() * self.slot.element_size()
        return sum(p.nbytes if self.packed else p.numel() * p.element_size() for p in (self.gate_up, self.down))


class ExpertSource(Protocol):
    """The slow tier (the packed artifact). `nbytes` must be cheap: the cache calls it under its lock."""

    def nbytes(self, layer: int, expert: int, bits: int) -> int:
        """Bytes of the compute-ready weights `load` returns for this expert at this precision."""
        ...

    def load(self, layer: int, expert: int, bits: int) -> ExpertWeights:
        """Read, unpack and dequantize one expert; may be slow; called without the cache lock held."""
        ...


Admission = Callable[[tuple[int, int], int, list[tuple[tuple[int, int], int]], bool], bool]


class FastTier:
    """The fast tier's byte count with admission control (001 §3.3's budget tracker): reserve before allocating,
    release after freeing. The one count of the expert bytes: the cache reserves and releases, the source sizes its
    slot pools against it.

    `reserve` never lets the reserved bytes exceed the capacity; a failed reservation changes nothing. `peak` is the
    high-water mark of reserved bytes. A capacity of 0 (no cache: every expert resident on the device, or served
    without caching) refuses every reservation. All methods are thread-safe.
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise HexqError(f"a fast tier of {capacity} bytes: give 0 or more")
        self._capacity = int(capacity)
        self._used = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def available(self) -> int:
        with self._lock:
            return self._capacity - self._used

    def reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit under the capacity; False (and no change) otherwise."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative byte count ({nbytes})")
        with self._lock:
            if self._used + nbytes > self._capacity:
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            return True

    def release(self, nbytes: int) -> None:
        """Return `nbytes` reserved earlier; releasing more than is reserved is an accounting bug and raises."""
        if nbytes < 0:
            raise ValueError(f"cannot release a negative byte count ({nbytes})")
        with self._lock:
            if nbytes > self._used:
                raise ValueError(f"release of {nbytes} bytes exceeds the {self._used} bytes reserved")
            self._used -= nbytes


@dataclass(frozen=True)
class ExpertVersion:
    """One fully materialised version of an expert. `version` increases with every publish of the same handle."""

    bits: int
    weights: ExpertWeights
    version: int
    nbytes: int


class ExpertHandle:
    """Stable identity of one (layer, expert) (001 §3.2): resolves to the published ExpertVersion or None.

    `resolve` is lock-free: the active version is swapped in a single reference assignment, so a reader gets either
    the previous or the next complete version. Only the cache publishes and unpublishes (under its lock).
    """

    __slots__ = ("layer", "expert", "_active", "_published")

    def __init__(self, layer: int, expert: int):
        self.layer = layer
        self.expert = expert
        self._active: ExpertVersion | None = None
        self._published = 0

    def resolve(self) -> ExpertVersion | None:
        return self._active

    def _publish(self, weights: ExpertWeights, nbytes: int) -> ExpertVersion:
        self._published += 1
        version = ExpertVersion(bits=weights.bits, weights=weights, version=self._published, nbytes=nbytes)
        self._active = version
        return version

    def _unpublish(self) -> ExpertVersion | None:
        old, self._active = self._active, None
        return old

    def __repr__(self) -> str:
        v = self._active
        state = "empty" if v is None else f"{v.bits} bits v{v.version}"
        return f"ExpertHandle(layer={self.layer}, expert={self.expert}, {state})"


@dataclass
class CacheStats:
    """Counters of one ExpertCache (a copy is returned by ExpertCache.stats).

    hits/misses count `get` calls: a hit is served without the caller issuing a load (possibly after waiting for a
    load already in flight - that stall is in wait_seconds); a miss loads (fill, promotion or bypass).
    promotions: loads that replaced a lower-precision copy (from get or prefetch). evictions: entries dropped to
    make room for other experts. bytes_moved: bytes of every successful load from the source. wait_seconds: time
    `get` was blocked (its own loads and waits on in-flight ones). load_seconds: time inside source.load, any
    thread. prefetch_issued: prefetch calls; of those, prefetch_skipped were already resident or on their way,
    prefetch_dropped found no room (or failed, or were cancelled by close), and prefetch_used were later hit by get.
    bypass_loads: misses served by a transient, uncached load; admission_declined: fills (get or prefetch) the
    admission callback turned down (a declined get is also a bypass load).
    """

    hits: int = 0
    misses: int = 0
    promotions: int = 0
    evictions: int = 0
    bypass_loads: int = 0
    bytes_moved: int = 0
    wait_seconds: float = 0.0
    load_seconds: float = 0.0
    prefetch_issued: int = 0
    prefetch_skipped: int = 0
    prefetch_dropped: int = 0
    prefetch_used: int = 0
    admission_declined: int = 0
    layer_hits: dict[int, int] = field(default_factory=dict)
    layer_misses: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
