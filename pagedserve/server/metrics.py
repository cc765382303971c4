"""Prometheus metrics, in a registry of the app's own (two apps in one process stay apart).

Engine state (queues, KV blocks, token counters, the core process's CPU time) is read from
each engine core's latest ``EngineStats`` snapshot when scraped. Latencies are what clients
see: they are timed in the handlers, from the moment a request arrives to the moment its
tokens reach the handler. Every sample carries the served model's name as ``model_name``, as
vLLM's do, so that a server of several models reports each; engine state carries the engine's
index as ``engine`` too, as vLLM's does ("0" for a model of one engine; with
``--data-parallel-size``, one series per replica: ``sum by (model_name)`` adds them up).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

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
MODEL_LABEL = "model_name"
ENGINE_LABEL = "engine"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Mapping[str, Callable[[], Sequence[EngineStats | None]]]) -> None:
        self._stats = stats  # by model name, each engine's

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, stats in self._stats.items():
            for engine, s in enumerate(stats()):
                if s is None:  # this engine core has not reported yet
                    continue
                for kind, name, doc, labels, value in _samples(s):
                    family = families.get(name)
                    if family is None:
                        family = families[name] = kind(
                            PREFIX + name, doc, labels=[MODEL_LABEL, ENGINE_LABEL, *labels])
                    family.add_metric([model, str(engine), *labels.values()], value)
        yield from families.values()


Sample = tuple[type, str, str, dict[str, str], float]  # kind, name, help, labels, value


def _samples(s: EngineStats) -> Iterator[Sample]:
    """Each metric one engine's stats give (the model's and engine's labels are the
    collector's)."""
    hit_rate = s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens \
        else 0.0
    gauges = [
        ("num_requests_running", "Requests being computed", s.num_running),
        ("num_requests_waiting", "Requests waiting to be scheduled (or for their grammar "
         "to compile)", s.num_waiting),
        ("num_requests_swapped", "Requests swapped out to host memory", s.num_swapped),
        ("kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", s.kv_usage),
        ("kv_cache_blocks_used", "KV cache blocks held by requests", s.blocks_used),
        ("kv_cache_blocks_free", "KV cache blocks free (cached or empty)", s.blocks_free),
        ("kv_cache_blocks_total", "KV cache blocks in the pool", s.num_blocks),
        ("prefix_cache_hit_rate", "Share of queried prompt tokens found in the prefix "
         "cache since start", hit_rate),
    ]
    for name, doc, value in gauges:
        yield GaugeMetricFamily, name, doc, {}, value
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
        yield CounterMetricFamily, name, doc, {}, value
    yield from _offload_samples(s)
    yield from _spec_decode_samples(s)


def _offload_samples(s: EngineStats) -> Iterator[Sample]:
    """The prefix cache by tier, and the KV offloading tiers' traffic."""
    for tier in ("device", "host", "disk"):
        yield (GaugeMetricFamily, "prefix_cache_hit_rate_by_tier", "Share of queried prompt "
               "tokens served by each tier since start", {"tier": tier},
               s.prefix_hit_rate_of(tier))
    for tier, hit, miss in (("host", s.offload_host_hits, s.offload_host_misses),
                            ("disk", s.offload_disk_hits, s.offload_disk_misses)):
        yield (CounterMetricFamily, "kv_offload_hits", "Prefix blocks found in an offloading "
               "tier after the tiers above missed", {"tier": tier}, hit)
        yield (CounterMetricFamily, "kv_offload_misses", "Prefix lookups an offloading tier "
               "missed (disk: bad files too)", {"tier": tier}, miss)
    for direction, value in (("to_host", s.offload_bytes_to_host),
                             ("to_device", s.offload_bytes_to_device),
                             ("to_disk", s.offload_bytes_to_disk),
                             ("from_disk", s.offload_bytes_from_disk)):
        yield (CounterMetricFamily, "kv_offload_bytes", "KV bytes moved between the tiers "
               "(swap included)", {"direction": direction}, value)
    yield (CounterMetricFamily, "kv_offload_copy_seconds", "Host time spent queuing and "
           "waiting on KV block moves", {}, s.offload_copy_s)


def _spec_decode_samples(s: EngineStats) -> Iterator[Sample]:
    """Speculative decoding's counters, under vLLM's names; none without it."""
    if not s.spec_accepted_per_position:
        return
    for name, doc, value in (
            ("spec_decode_num_drafts", "Verify steps of a sequence that carried drafts",
             s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted",
             s.spec_num_accepted_tokens)):
        yield CounterMetricFamily, name, doc, {}, value
    for position, value in enumerate(s.spec_accepted_per_position):
        yield (CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos", "Verify steps "
               "that accepted the draft at each position (0: the first draft)",
               {"position": str(position)}, value)


class ServerMetrics:
    """The server's registry; ``stats`` gives each served model's engines' latest stats, by
    the model's name."""

    def __init__(self, stats: Mapping[str, Callable[[], Sequence[EngineStats | None]]]
                 ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        # CPU seconds and memory of the server process (``bench serve`` reads the CPU time).
        ProcessCollector(registry=self.registry)
        labels = [MODEL_LABEL]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from a request's arrival to its first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive tokens of a request", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter(PREFIX + "request_finished", "Requests ended, by reason "
                                "(stop, length, abort: client gone, error)",
                                [MODEL_LABEL, "finished_reason"], registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def of(self, model: str) -> ModelMetrics:
        return ModelMetrics(self.ttft.labels(model), self.itl.labels(model),
                            self.e2e.labels(model), partial(self.finished.labels, model))


@dataclass(frozen=True)
class ModelMetrics:
    """The latency histograms of one served model, and its finished-request counter by
    reason."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    finished: Callable[[str], Counter]


@dataclass
class RequestTimer:
    """Latencies of one engine request, fed with its growing token count."""

    metrics: ModelMetrics
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
        self.metrics.finished(reason).inc()
