"""`GET /metrics`: the server's counters in Prometheus text format (prometheus_client, one registry per server).

Requests by endpoint and status, prompt and generated tokens, time to first token (from the request's arrival, so
queueing counts) and time per output token (each decode step) as histograms, the queue, and the runtime's own
figures read when scraped: expert-cache hits, misses and hit rate, bytes moved into the cache and read from the
artifact, the memory budget and the process's resident set (current, peak, and at start before the artifact was
loaded: what the interpreter and libraries take outside the budget).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from hexq.base.devices import peak_rss_bytes

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: TTFT spans a tiny model's prefill (ms) to a queued request behind long generations (minutes)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RuntimeCollector:
    """The runtime's counters, read at scrape time."""

    def __init__(self, runtime, startup_rss: int | None) -> None:
        self.runtime = runtime
        self.startup_rss = startup_rss

    def collect(self):
        stats = self.runtime.cache.stats
        lookups = stats.hits + stats.misses
        yield CounterMetricFamily("hexq_cache_hits", "Expert-cache lookups served from the fast tier.", stats.hits)
        yield CounterMetricFamily("hexq_cache_misses", "Expert-cache lookups that loaded.", stats.misses)
        yield GaugeMetricFamily("hexq_cache_hit_rate", "Hits over lookups since start (1 when every expert is "
                                "resident and the native step reads them directly).",
                                stats.hits / lookups if lookups else 1.0)
        yield CounterMetricFamily("hexq_cache_bytes_moved", "Bytes loaded into the expert cache.", stats.bytes_moved)
        yield CounterMetricFamily("hexq_artifact_bytes_read", "Bytes read from the artifact's expert shards.",
                                  self.runtime.artifact.bytes_read)
        if self.runtime.plan.memory_bytes is not None:
            yield GaugeMetricFamily("hexq_memory_bytes", "--memory: the budget for what hexq allocates.",
                                    self.runtime.plan.memory_bytes)
        peak = peak_rss_bytes()
        if peak is not None:
            yield GaugeMetricFamily("hexq_peak_rss_bytes", "The process's peak resident set (VmHWM).", peak)
        if self.startup_rss is not None:
            yield GaugeMetricFamily("hexq_startup_rss_bytes", "Resident set before the artifact was loaded "
                                    "(interpreter and libraries, outside --memory).", self.startup_rss)


class Metrics:
    def __init__(self, runtime, worker, startup_rss: int | None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hexq_requests", "HTTP requests answered.", ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("hexq_prompt_tokens", "Prompt tokens of served requests.",
                                     registry=self.registry)
        self.reused_tokens = Counter("hexq_prompt_tokens_reused", "Prompt tokens whose keys and values came from "
                                     "the previous request's prompt instead of a prefill.", registry=self.registry)
        self.generated_tokens = Counter("hexq_generated_tokens", "Tokens generated.", registry=self.registry)
        self.finished = Counter("hexq_sequences", "Sequences ended, by reason (stop, length, cancelled).",
                                ["reason"], registry=self.registry)
        self.ttft = Histogram("hexq_time_to_first_token_seconds", "From a request's arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("hexq_time_per_output_token_seconds", "Each decode step.", buckets=TPOT_BUCKETS,
                              registry=self.registry)
        queue = Gauge("hexq_queue_length", "Requests waiting for the generation worker.", registry=self.registry)
        queue.set_function(lambda: worker.waiting)
        running = Gauge("hexq_running", "Sequences being generated (0 or 1).", registry=self.registry)
        running.set_function(lambda: worker.running)
        self.registry.register(RuntimeCollector(runtime, startup_rss))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends, where /proc exists

    def observe(self, job, first_token_seconds, steps, completion_tokens, reason) -> None:
        """The worker's report of one finished job."""
        self.prompt_tokens.inc(len(job.ids))
        self.reused_tokens.inc(job.reused)
        self.generated_tokens.inc(completion_tokens)
        self.finished.labels(reason).inc()
        if first_token_seconds is not None:
            self.ttft.observe(first_token_seconds)
        for seconds in steps:
            self.tpot.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
