"""Prometheus metrics of the serving process, scraped at `GET /metrics`.

Each `Metrics` owns its registry (several apps can live in one test process). Request counters
and histograms are observed by the inference routes, feedback outcomes by the webhooks;
engine and session-log state (batch size, active rows, log queue depth, spool size), the
online trainer's status row and the join's lag are read at scrape time from the bound objects.

Names follow Prometheus' conventions: one `flywheel_` prefix, base units (`_seconds`,
`_bytes`), `_total` on counters (prometheus_client appends it to a Counter's samples), no
user, session or generation ids as labels. The online trainer's step metrics carry the names
its trackers give them (trainer/trackers.py `metric_name`). deploy/grafana/flywheel.json
charts them; tests/app/api/test_metrics_names.py checks both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trainer.trackers import metric_name

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# why a webhook was refused: the error codes of app/api/routes/feedback.py's refusals
REJECTION_REASONS = ("invalid_signature", "invalid_body", "request_too_large",
                     "batch_too_large", "log_unavailable", "private_generation")


class _LiveState(Collector):
    """Engine and session-log figures, read when scraped."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.session_log: Any = None
        self.trainer_db: Any = None  # the SQL engine holding the trainer's status row
        self.join_lag: Any = None  # () -> list[ingest.offsets.PartitionLag]

    def collect(self) -> Iterator[Metric]:
        yield from self._serving()
        if self.trainer_db is not None:
            yield from self._trainer()
        if self.join_lag is not None:
            yield from self._join_lag()

    def _join_lag(self) -> Iterator[Metric]:
        partitions = self.join_lag()  # as last read: a scrape never waits on the broker
        lag = GaugeMetricFamily("flywheel_join_lag_records", "Records of the join's input "
                                "topics its group has not committed past",
                                labels=["topic", "partition"])
        for p in partitions:
            lag.add_metric([p.topic, str(p.partition)], p.lag)
        yield lag

    def _trainer(self) -> Iterator[Metric]:
        from trainer.online.control import breach_counts, ensure_control_tables, read_status

        db = ensure_control_tables(self.trainer_db)
        row = read_status(db)
        if row is None:  # no trainer has reported yet
            return
        breaches = CounterMetricFamily("flywheel_monitor_breaches",
                                       "Reward-hacking monitors that tripped, by monitor",
                                       labels=["monitor"])
        for monitor, count in sorted(breach_counts(db).items()):
            breaches.add_metric([monitor], count)
        yield breaches
        yield GaugeMetricFamily("flywheel_online_step", "The online trainer's optimizer steps",
                                value=row.step)
        yield CounterMetricFamily("flywheel_online_experiences_trained",
                                  "Experiences the online trainer has trained on",
                                  value=row.consumed)
        yield GaugeMetricFamily("flywheel_online_lag_records",
                                "Experiences on the log the trainer has not read yet",
                                value=row.lag or 0)
        yield GaugeMetricFamily("flywheel_online_paused", "1 while the trainer is paused",
                                value=int(row.paused))
        for key, value in sorted(row.metrics.items()):
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(metric_name("online", key),
                                        f"The online trainer's last step: {key}", value=value)

    def _serving(self) -> Iterator[Metric]:
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
        # blocks that look like a call but do not parse or name no offered tool, by the
        # version that wrote them: a rising rate is a known reward hack (dodging negative
        # reward with broken calls)
        self.invalid_tool_calls = Counter(
            "flywheel_invalid_tool_calls", "Tool calls the model wrote that did not parse or "
            "named a tool the request did not offer", ["model_version"], registry=self.registry)
        self.private_generations = Counter(
            "flywheel_private_generations", "Generations served in privacy mode: counted, "
            "never logged to sessions nor trained on", ["endpoint"], registry=r)
        self.feedback_events = Counter("flywheel_feedback_events", "Feedback events accepted "
                                       "by the webhooks", ["outcome"], registry=r)
        self.feedback_rejected = Counter("flywheel_feedback_rejected", "Webhook requests "
                                         "refused, by reason", ["reason"], registry=r)
        for outcome in ("new", "duplicate"):
            self.feedback_events.labels(outcome)
        for reason in REJECTION_REASONS:
            self.feedback_rejected.labels(reason)
        self._live = _LiveState()
        r.register(self._live)

    def bind(self, *, engine: Any = None, session_log: Any = None, trainer_db: Any = None,
             join_lag: Any = None) -> None:
        """Read these at scrape time; the engine reports each decode step's batch size."""
        self._live.engine = engine
        self._live.session_log = session_log
        self._live.trainer_db = trainer_db
        self._live.join_lag = join_lag
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

    def observe_feedback(self, *, new: int, duplicates: int) -> None:
        self.feedback_events.labels("new").inc(new)
        self.feedback_events.labels("duplicate").inc(duplicates)

    def reject_feedback(self, reason: str) -> None:
        self.feedback_rejected.labels(reason).inc()

    @staticmethod
    def counted(counter: Counter, labels: dict[str, str] | None = None) -> float:
        """One counter's count over its samples matching `labels` (all: the total), for the
        console. Read from the counter alone: a read of the registry runs every collector,
        the trainer's status query in SQL among them."""
        return sum(s.value for m in counter.collect() for s in m.samples
                   if s.name.endswith("_total")
                   and all(s.labels.get(k) == v for k, v in (labels or {}).items()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
