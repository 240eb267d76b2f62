"""The generation worker: one thread owns the Runtime and serves its queue one sequence at a time, in arrival order.

Why one at a time: the runtime decodes one sequence per step (the native step and the expert cache are built for a
batch of one), and its cache, prefetch and policies then see the requests' traffic as it comes. Requests wait in a
bounded queue (`max_queue` waiting; beyond it `submit` raises QueueFull, which the API answers with 503). Events
travel back to the request's coroutine through its asyncio queue; a request whose client went away is cancelled
and its generation stops before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from hexq.runtime.sampling import Sampling, TextStream

log = logging.getLogger("hexq.serve")


class QueueFull(Exception):
    """More requests are waiting than the server's --max-queue."""


@dataclass
class Job:
    """One request's sequence: prompt ids, how many tokens at most, how to sample, where to stop. `events` receives
    ("text", piece), then ("done", finish_reason, completion_tokens) or ("error", message); `reused` is set before
    "done": the prompt's positions taken from the previous request's (hexq.runtime.prefix)."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    reused: int = 0

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    """The thread that runs every Job on `runtime` (see the module docstring). `observer`, when set, gets
    (job, first_token_seconds, step_seconds list, completion_tokens, finish_reason) after each job, for metrics."""

    def __init__(self, runtime, max_queue: int, observer=None, tokenizer_lock: threading.Lock | None = None) -> None:
        self.runtime = runtime
        self.max_queue = max_queue
        self.observer = observer
        self.tokenizer_lock = tokenizer_lock or threading.Lock()
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0  # jobs submitted and not yet started
        self.running = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="hexq-generate", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.waiting} requests are waiting (--max-queue {self.max_queue})")
            self.waiting += 1
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            with self._lock:
                self.waiting -= 1
                self.running = 1
            try:
                if job.cancelled.is_set():
                    job.emit("done", "cancelled", 0)
                    continue
                self._generate(job)
            except Exception as exc:  # the request fails, the server keeps serving
                log.exception("generation failed")
                job.emit("error", f"generation failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            finally:
                with self._lock:
                    self.running = 0

    def _generate(self, job: Job) -> None:
        runtime = self.runtime
        stream = TextStream(runtime.tokenizer, job.stop)
        steps: list[float] = []
        first = None
        count = 0
        reason = "length"
        for token in runtime.tokens(job.ids, job.max_tokens, job.sampling, steps):
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            count += 1
            first = time.perf_counter() - job.arrived if first is None else first
            if token == runtime.tokenizer.eos_token_id:
                reason = "stop"
                break
            with self.tokenizer_lock:
                piece = stream.push(token)
            if piece:
                job.emit("text", piece)
            if stream.stopped:
                reason = "stop"
                break
        if reason != "cancelled":
            with self.tokenizer_lock:
                piece = stream.finish()
            if piece:
                job.emit("text", piece)
        job.reused = runtime.reused
        job.emit("done", reason, count)
        if self.observer is not None:
            self.observer(job, first, steps, count, reason)
