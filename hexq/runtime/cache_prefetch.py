"""The expert cache's prefetch worker (004 §4.4.1, look-ahead prefetch; 001 §3.4, transitions on a worker of their own
so the forward pass never waits on them): `prefetch` queues a background fill and returns at once, one thread
admits and loads each queued expert or drops it, `wait_idle` waits for the queue. The cache's state, lock and
admission rules are hexq.runtime.cache.ExpertCache's; this is the part of it that runs on the worker thread."""

from __future__ import annotations

import logging

from hexq.runtime.residency import Key

logger = logging.getLogger("hexq.runtime.cache")


class PrefetchWorker:
    """ExpertCache's background fills (mixed into it: the attributes used here are the cache's)."""

    def prefetch(self, layer: int, expert: int, bits: int) -> None:
        """Queue a background fill of (layer, expert) at `bits`; returns at once (004 §4.4.1).

        The worker admits it only if room can be made without evicting pinned entries and drops it otherwise
        (counted in prefetch_dropped). A queued request for the same expert is raised to the higher precision.
        """
        key = (layer, expert)
        with self._lock:
            self._check_open()
            self._raise_worker_error()
            self._stats.prefetch_issued += 1
            on_way = max(self._inflight.get(key, 0), self._queued.get(key, 0))
            if self._hit_version(key, bits) is not None or on_way >= bits:
                self._stats.prefetch_skipped += 1
                return
            if key in self._queued:  # the queued request now asks for more bits; no second queue entry
                self._stats.prefetch_skipped += 1
                self._queued[key] = bits
                return
            self._queued[key] = bits
        self._queue.put(key)

    def wait_idle(self) -> None:
        """Block until every prefetch queued so far has been loaded or dropped (raises the worker's error)."""
        self._queue.join()
        with self._lock:
            self._raise_worker_error()

    def _work(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._prefetch_one(key)
            except Exception as error:  # kept for the forward pass to raise (module docstring), not printed here
                logger.debug("prefetch of expert %s failed", key, exc_info=True)
                with self._lock:
                    if self._error is None:
                        self._error = error
            finally:
                self._queue.task_done()

    def _prefetch_one(self, key: Key) -> None:
        with self._lock:
            bits = self._queued.pop(key, None)
            if bits is None or self._closed:
                return
            if self._error is not None:  # the worker stops after its first failure
                self._stats.prefetch_dropped += 1
                return
            if self._hit_version(key, bits) is not None or self._inflight.get(key, 0) >= bits:
                self._stats.prefetch_skipped += 1
                return
            if key in self._inflight:  # a lower precision is still loading; the worker does not wait for it
                self._stats.prefetch_dropped += 1
                return
            need = self._source.nbytes(key[0], key[1], bits)
            promoting = key in self._lru
            if need > self._fast_tier.capacity or not self._admit(key, bits, need, background=True):
                self._stats.prefetch_dropped += 1
                logger.debug("prefetch of expert %s at %d bits dropped: no unpinned room", key, bits)
                return
            self._start_fill(key, bits, promoting)
        try:
            self._fill(key, bits, need, prefetched=True)
        except Exception:
            with self._lock:
                self._stats.prefetch_dropped += 1
            raise
