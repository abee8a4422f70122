"""Prometheus metrics of the tokenizer process (prometheus_client: the standard exposition
format, histograms and registries, rather than a hand-written text format)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.prompt_tokens = counter("minisgl_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("minisgl_generation_tokens", "Generated tokens")
        self.cached_tokens = counter("minisgl_cached_tokens", "Prompt tokens served from the prefix cache")
        self.requests = counter("minisgl_requests_finished", "Finished requests")
        self.request_errors = counter("minisgl_request_errors", "Requests that failed")
        self.ttft = hist("minisgl_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = hist("minisgl_inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = hist("minisgl_e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.running = gauge("minisgl_num_running_requests", "Requests holding KV in the scheduler")
        self.queued = gauge("minisgl_num_queued_requests", "Requests waiting in the scheduler")
        self.kv_usage = gauge("minisgl_kv_token_usage", "Fraction of KV slots in use by requests")
        self.kv_total = gauge("minisgl_kv_total_tokens", "KV slots in the pool")
        self.cache_hit_rate = gauge("minisgl_prefix_cache_hit_rate", "Prompt tokens served from the cache / prompt tokens")
        self.gen_throughput = gauge("minisgl_gen_throughput", "Generated tokens per second over the last interval")
        self._last_gen: tuple[float, float] | None = None

    def update_from_stats(self, stats: dict[str, Any], now: float) -> None:
        total = stats.get("total_tokens") or 0
        self.running.set(stats.get("running", 0))
        self.queued.set(stats.get("waiting", 0))
        self.kv_total.set(total)
        if total:
            in_use = total - stats.get("free_tokens", 0) - stats.get("evictable_tokens", 0)
            self.kv_usage.set(in_use / total)
        prompt = stats.get("prefill_tokens", 0) + stats.get("cached_prompt_tokens", 0)
        if prompt:
            self.cache_hit_rate.set(stats.get("cached_prompt_tokens", 0) / prompt)
        generated = float(stats.get("decode_tokens", 0))
        if self._last_gen is not None and now > self._last_gen[0]:
            self.gen_throughput.set(max(0.0, generated - self._last_gen[1]) / (now - self._last_gen[0]))
        self._last_gen = (now, generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
