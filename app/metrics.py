"""Prometheus metrics of the serving process, scraped at `GET /metrics`.

Each `Metrics` owns its registry (several apps can live in one test process). Request counters
and histograms are observed by the inference routes; engine and session-log state (batch size,
active rows, log queue depth, spool size) is read at scrape time from the bound objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _LiveState(Collector):
    """Engine and session-log figures, read when scraped."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.session_log: Any = None

    def collect(self) -> Iterator[Metric]:
        if self.engine is not None and hasattr(self.engine, "active"):
            yield GaugeMetricFamily("flywheel_engine_active_requests",
                                    "Requests in the running batch", value=self.engine.active)
        if self.session_log is not None:
            s = self.session_log.stats()
            yield GaugeMetricFamily("flywheel_session_log_queue_depth",
                                    "GenerationLogged records in memory, not yet acknowledged",
                                    value=s.queued)
            yield GaugeMetricFamily("flywheel_session_log_spool_records",
                                    "Records in the local spool awaiting replay",
                                    value=s.spool_records)
            yield GaugeMetricFamily("flywheel_session_log_spool_bytes",
                                    "Bytes in the local spool awaiting replay",
                                    value=s.spool_bytes)
            for name, value, doc in (("sent", s.sent, "acknowledged on the first try"),
                                     ("spilled", s.spilled, "written to the spool"),
                                     ("replayed", s.replayed, "acknowledged from the spool")):
                yield CounterMetricFamily(f"flywheel_session_log_{name}",
                                          f"Session records {doc}", value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flywheel_requests", "Inference requests",
                                ["endpoint"], registry=r)
        self.generations = Counter("flywheel_generations", "Generations (choices) served",
                                   ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("flywheel_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.completion_tokens = Counter("flywheel_completion_tokens",
                                         "Completion tokens generated", registry=r)
        self.request_latency = Histogram("flywheel_request_latency_seconds",
                                         "Time to the whole response (streams: to the headers)",
                                         ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.generation_latency = Histogram("flywheel_generation_latency_seconds",
                                            "Time from submit to the last token",
                                            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("flywheel_time_to_first_token_seconds",
                              "Time from submit to the first token", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("flywheel_engine_batch_size",
                                    "Rows in each batched decode step",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self._live = _LiveState()
        r.register(self._live)

    def bind(self, *, engine: Any = None, session_log: Any = None) -> None:
        """Read these at scrape time; the engine reports each decode step's batch size."""
        self._live.engine = engine
        self._live.session_log = session_log
        if engine is not None and hasattr(engine, "on_step"):
            engine.on_step = self.batch_size.observe

    def observe_request(self, endpoint: str, latency_s: float) -> None:
        self.requests.labels(endpoint).inc()
        self.request_latency.labels(endpoint).observe(latency_s)

    def observe_generation(self, *, endpoint: str, prompt_tokens: int, completion_tokens: int,
                           latency_s: float, ttft_s: float | None, finish_reason: str) -> None:
        self.generations.labels(endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.generation_latency.labels(endpoint).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
