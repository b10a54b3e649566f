"""GET /metrics: Prometheus text, vLLM's metric names under the `tokenmill:` prefix.

Per-request numbers (finish status, TTFT, TPOT, end-to-end latency, prompt and generation tokens)
are recorded by the front end as requests end (AsyncLLM's stat logger). The engine core's state
(running / waiting, KV usage, prefix-cache hit rate, preemptions, aborted requests) is fetched with
a utility call at scrape time, so it is current (e.g. KV usage is back to 0 once blocks are freed).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.async_llm import RequestStats

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")

disable_created_metrics()  # no `*_created` series next to every counter and histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCoreCollector:
    """The engine core's last reported stats, exposed as gauges and counters."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self):
        st, labels = self.stats, [self.model_name]
        gauges = (
            ("tokenmill:num_requests_running", "Requests in the running batch", "num_running"),
            ("tokenmill:num_requests_waiting", "Requests waiting to be scheduled", "num_waiting"),
            ("tokenmill:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)", "kv_cache_usage"),
            ("tokenmill:prefix_cache_hit_rate", "Prefix-cache hit rate (tokens) since start", "prefix_cache_hit_rate"),
            ("tokenmill:num_ranks_precompiling", "Engine ranks still compiling shape buckets in the background",
             "num_precompiling"),
        )
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, float(st.get(key, 0.0)))
            yield g
        counters = (
            ("tokenmill:num_preemptions", "Preemptions since start", "num_preemptions"),
            ("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
            ("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
            ("tokenmill:num_aborted_requests", "Requests aborted in the engine core", "num_aborted_requests"),
            ("tokenmill:spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens computed",
             "num_draft_tokens"),
            ("tokenmill:spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted",
             "num_accepted_tokens"),
        )
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, float(st.get(key, 0)))
            yield c


class Metrics:
    """A private registry per server (tests start several); also AsyncLLM's stat logger."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        label = ["model_name"]
        self.request_success = Counter("tokenmill:request_success", "Finished requests by finish reason",
                                       label + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed", label, registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated", label, registry=r)
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token", label,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tokenmill:time_per_output_token_seconds", "Mean time per output token after the first",
                              label, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "End-to-end request latency", label,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_healthy = Gauge("tokenmill:engine_healthy", "1 while the engine core is alive", label, registry=r)
        self.engine_healthy.labels(model_name).set(1)
        self.core = _EngineCoreCollector(model_name)
        r.register(self.core)

    def record_request(self, stats: RequestStats) -> None:
        name = self.model_name
        reason = stats.finish_reason if stats.finish_reason in FINISH_REASONS else "stop"
        self.request_success.labels(name, reason).inc()
        self.prompt_tokens.labels(name).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(stats.num_generation_tokens)
        if stats.first_token_time is not None:
            self.ttft.labels(name).observe(stats.first_token_time - stats.arrival_time)
            if stats.num_generation_tokens > 1 and stats.last_token_time is not None:
                self.tpot.labels(name).observe(
                    (stats.last_token_time - stats.first_token_time) / (stats.num_generation_tokens - 1))
        self.e2e.labels(name).observe(time.monotonic() - stats.arrival_time)

    async def render(self, engine) -> bytes:
        if engine.errored:
            self.engine_healthy.labels(self.model_name).set(0)
        else:
            try:
                self.core.stats = await engine.get_stats(timeout=2.0)
            except Exception as e:  # noqa: BLE001 - serve the last known values
                logger.warning("could not fetch engine stats: %s", e)
        return generate_latest(self.registry)
