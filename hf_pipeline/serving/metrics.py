"""The server's ``GET /metrics``: Prometheus text, from ``prometheus_client``, one registry per app.

What vLLM's and transformers serve's dashboards read, named ``hf_pipeline_*``:

* gauges read from the engine when scraped: requests queued, rows running, the KV pool's rows
  (continuous batching: how many rows the pool holds at most), the largest KV cache a rank held, and
  the prefill chunks run, prefix-cache hits and tokens reused (totals);
* counters: requests answered (by HTTP status), prompt and generated tokens (their ``rate()`` is
  tokens/s);
* histograms: time to first token and whole-request time.

Example:
    >>> metrics = ServerMetrics(engine)
    >>> metrics.first_token(started)           # when a request's first tokens arrive
    >>> metrics.finished(200, started, prompt_tokens=12, completion_tokens=16)
    >>> body, content_type = metrics.exposition()
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ServerMetrics"]

# Seconds: a pipelined decode step on a CPU is milliseconds, a long prompt's prefill seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The counters, gauges and histograms of one app, in a registry of its own (two apps in one
    process, as in tests, do not share or collide)."""

    def __init__(self, engine: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        gauges = {
            "hf_pipeline_queued_requests": ("Requests waiting for rows", lambda: engine.queued),
            "hf_pipeline_running_rows": ("Rows (choices) being generated", lambda: len(engine.running)),
            "hf_pipeline_kv_pool_rows": ("Rows the KV pool holds at most (continuous batching)", lambda: engine.pool),
            "hf_pipeline_peak_kv_cache_bytes": ("Largest KV cache this rank held", lambda: engine.peak_cache_bytes),
            # engine totals, so counters' semantics; read as gauges when scraped (they only grow)
            "hf_pipeline_prefill_chunks": ("Row ops that ran part of a prompt split over several steps",
                                           lambda: engine.prefill_chunks),
            "hf_pipeline_prefix_cache_hits": ("Rows that reused a cached prompt prefix", lambda: engine.prefix_hits),
            "hf_pipeline_prefix_cache_tokens": ("Prompt tokens reused from the prefix cache",
                                                lambda: engine.prefix_tokens),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda read=read: float(read() or 0))
        self.requests = Counter("hf_pipeline_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("hf_pipeline_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generated = Counter("hf_pipeline_generation_tokens", "Tokens generated (stop tokens included)",
                                 registry=r)
        self.ttft = Histogram("hf_pipeline_time_to_first_token_seconds", "From submission to the first tokens",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("hf_pipeline_request_seconds", "From submission to the last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)

    def first_token(self, started: float) -> None:
        """A request's first tokens arrived (``started``: ``time.monotonic()`` at submission)."""
        self.ttft.observe(time.monotonic() - started)

    def finished(self, status: int, started: float | None = None, *, prompt_tokens: int = 0,
                 completion_tokens: int = 0) -> None:
        """A request was answered with ``status`` (refusals too, without timings)."""
        self.requests.labels(status=str(status)).inc()
        if started is not None:
            self.latency.observe(time.monotonic() - started)
        self.prompt_tokens.inc(prompt_tokens)
        self.generated.inc(completion_tokens)

    def exposition(self) -> tuple[bytes, str]:
        """The scrape's body and content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
