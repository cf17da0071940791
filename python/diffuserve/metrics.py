"""Prometheus metrics of the server, on their own registry (several servers can live in one
process, e.g. in tests).

Request-level counters are updated by the server as requests finish; the engine's own
numbers (KV blocks, queue depth, prefix cache, forward passes) are read from its latest
stats at scrape time, so they are never stale and never double-counted.
"""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        used = s["kv_blocks_total"] - s["kv_blocks_free"]
        yield from [
            GaugeMetricFamily("diffuserve_requests_running", "Requests being computed", value=s["running"]),
            GaugeMetricFamily("diffuserve_requests_waiting", "Requests queued for admission", value=s["waiting"]),
            GaugeMetricFamily("diffuserve_kv_blocks_total", "KV cache blocks", value=s["kv_blocks_total"]),
            GaugeMetricFamily("diffuserve_kv_blocks_free", "KV cache blocks free (unreferenced cached ones count "
                              "as free)", value=s["kv_blocks_free"]),
            GaugeMetricFamily("diffuserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                              value=used / s["kv_blocks_total"] if s["kv_blocks_total"] else 0.0),
            CounterMetricFamily("diffuserve_prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache (once an engine request: each of a "
                                "request's n choices is one)",
                                value=s["prefix_cache_queries"]),
            CounterMetricFamily("diffuserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                value=s["prefix_cache_hits"]),
            CounterMetricFamily("diffuserve_preemptions", "Requests preempted for lack of KV cache",
                                value=s["preemptions"]),
            CounterMetricFamily("diffuserve_forward_passes", "Batched forward passes run", value=s["forward_passes"]),
        ]


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.requests = Counter("diffuserve_requests", "Generation requests (choices) by how they ended",
                                ["finish_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):  # at 0 from the start, for rate() and increase()
            self.requests.labels(reason)
        self.prompt_tokens = Counter("diffuserve_prompt_tokens", "Prompt tokens received", registry=self.registry)
        self.generation_tokens = Counter("diffuserve_generation_tokens", "Tokens generated", registry=self.registry)
        # As vLLM's e2e and first-token latencies, in seconds from the request's arrival: a block
        # is the first text a client sees.
        seconds = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
        self.latency = Histogram("diffuserve_e2e_request_latency_seconds",
                                 "Seconds from a request's arrival to its choice's end (any finish reason)",
                                 buckets=seconds, registry=self.registry)
        self.first_block = Histogram("diffuserve_time_to_first_block_seconds",
                                     "Seconds from a request's arrival to its choice's first committed block",
                                     buckets=seconds, registry=self.registry)
        self.queue_time = Histogram("diffuserve_request_queue_time_seconds",
                                    "Seconds from a request's arrival to the engine step that first ran its choice",
                                    buckets=seconds, registry=self.registry)
        self.denoise_steps = Histogram("diffuserve_denoise_steps_per_block", "Decoder passes per finished block",
                                       # (to the server's default limit of steps a block, 1,024)
                                       buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024),
                                       registry=self.registry)
        # As vLLM's http_requests_total: a 4xx or 5xx rate to alert on (a refused request, a 400,
        # had shown nowhere). Paths that are not the API's count as "other", so that a scanner's
        # requests add no series.
        self.http_requests = Counter("diffuserve_http_requests", "HTTP responses by endpoint, method and status",
                                     ["handler", "method", "status"], registry=self.registry)
        # As vLLM's http_request_duration_seconds: to the response's last byte (a stream's end),
        # or to the client's disconnect.
        self.http_duration = Histogram("diffuserve_http_request_duration_seconds",
                                       "Seconds from an HTTP request's arrival to its response's end, by endpoint "
                                       "and method", ["handler", "method"],
                                       buckets=(0.005, 0.01, 0.025) + seconds, registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats))

    def record(self, finish_reason: str, prompt_tokens: int, generated_tokens: int, denoise_steps,
               seconds: Optional[float] = None, first_block_seconds: Optional[float] = None,
               queue_seconds: Optional[float] = None) -> None:
        """One finished (or aborted) choice; seconds: from its request's arrival to its end;
        first_block_seconds: to its first committed block, if it had one; queue_seconds: to
        the engine step that first ran it, if the server saw one."""
        self.requests.labels(finish_reason).inc()
        if seconds is not None:
            self.latency.observe(seconds)
        if first_block_seconds is not None:
            self.first_block.observe(first_block_seconds)
        if queue_seconds is not None:
            self.queue_time.observe(queue_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        for steps in denoise_steps:
            self.denoise_steps.observe(steps)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
