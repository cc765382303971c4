"""Prometheus metrics, in a registry of the app's own (two apps in one process stay apart).

Engine state (queues, KV blocks, token counters, the core process's CPU time) is read from
the engine core's latest ``EngineStats`` snapshot when scraped. Latencies are what clients
see: they are timed in the handlers, from the moment a request arrives to the moment its
tokens reach the handler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.stats import EngineStats

PREFIX = "pagedserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:  # the engine core has not reported yet
            return
        hit_rate = s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens \
            else 0.0
        gauges = [
            ("num_requests_running", "Requests being computed", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory", s.num_swapped),
            ("kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", s.kv_usage),
            ("kv_cache_blocks_used", "KV cache blocks held by requests", s.blocks_used),
            ("kv_cache_blocks_free", "KV cache blocks free (cached or empty)", s.blocks_free),
            ("kv_cache_blocks_total", "KV cache blocks in the pool", s.num_blocks),
            ("prefix_cache_hit_rate", "Share of queried prompt tokens found in the prefix "
             "cache since start", hit_rate),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = [
            ("prompt_tokens", "Prompt tokens computed (prefix cache hits excluded)",
             s.prompt_tokens),
            ("generation_tokens", "Tokens generated", s.generation_tokens),
            ("num_preemptions", "Requests preempted to free KV blocks", s.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             s.prefix_queried_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
             s.prefix_hit_tokens),
            ("engine_core_cpu_seconds", "CPU time of the engine-core process",
             s.process_cpu_s),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield from _offload_metrics(s)


def _offload_metrics(s: EngineStats) -> Iterator[Metric]:
    """The prefix cache by tier, and the KV offloading tiers' traffic."""
    rate = GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate_by_tier", "Share of queried "
                             "prompt tokens served by each tier since start", labels=["tier"])
    for tier in ("device", "host", "disk"):
        rate.add_metric([tier], s.prefix_hit_rate_of(tier))
    yield rate
    hits = CounterMetricFamily(PREFIX + "kv_offload_hits", "Prefix blocks found in an "
                               "offloading tier after the tiers above missed", labels=["tier"])
    misses = CounterMetricFamily(PREFIX + "kv_offload_misses", "Prefix lookups an offloading "
                                 "tier missed (disk: bad files too)", labels=["tier"])
    for tier, hit, miss in (("host", s.offload_host_hits, s.offload_host_misses),
                            ("disk", s.offload_disk_hits, s.offload_disk_misses)):
        hits.add_metric([tier], hit)
        misses.add_metric([tier], miss)
    yield hits
    yield misses
    moved = CounterMetricFamily(PREFIX + "kv_offload_bytes", "KV bytes moved between the "
                                "tiers (swap included)", labels=["direction"])
    for direction, value in (("to_host", s.offload_bytes_to_host),
                             ("to_device", s.offload_bytes_to_device),
                             ("to_disk", s.offload_bytes_to_disk),
                             ("from_disk", s.offload_bytes_from_disk)):
        moved.add_metric([direction], value)
    yield moved
    yield CounterMetricFamily(PREFIX + "kv_offload_copy_seconds", "Host time spent queuing and "
                              "waiting on KV block moves", value=s.offload_copy_s)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        # CPU seconds and memory of the server process (``bench serve`` reads the CPU time).
        ProcessCollector(registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from a request's arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter(PREFIX + "request_finished", "Requests ended, by reason "
                                "(stop, length, abort: client gone, error)", ["finished_reason"],
                                registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


@dataclass
class RequestTimer:
    """Latencies of one engine request, fed with its growing token count."""

    metrics: ServerMetrics
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None
    num_tokens: int = 0
    reason: str | None = None

    def tokens(self, num_tokens: int) -> None:
        """The longest of the request's sequences now has ``num_tokens`` tokens."""
        if num_tokens <= self.num_tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            # Tokens that arrive together (the handler fell behind) share the gap evenly.
            gap = (now - self.last) / (num_tokens - self.num_tokens)
            for _ in range(num_tokens - self.num_tokens):
                self.metrics.itl.observe(gap)
        self.last, self.num_tokens = now, num_tokens

    def finish(self, reason: str) -> None:
        """Count the request once, under the first reason given."""
        if self.reason is not None:
            return
        self.reason = reason
        if reason in ("stop", "length"):
            self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.finished.labels(finished_reason=reason).inc()
