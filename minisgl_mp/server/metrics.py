"""Prometheus metrics of the tokenizer process (prometheus_client: the standard exposition
format, histograms and registries, rather than a hand-written text format)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# SGLang's default buckets, so its Grafana dashboard's quantiles read the same.
_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)


class Metrics:
    """SGLang's metric names and labels (sglang:*, label model_name), so dashboards built for
    SGLang work unchanged. Health probes and /metrics itself are not requests and are not
    counted; requests refused before they start are counted by reason (the RequestError kind)."""

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

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.request_errors = counter("sglang:num_failed_requests_total",
                                      "Requests that failed after they started (not in SGLang).")
        self._refused = Counter("sglang:num_refused_requests_total",
                                "Requests refused before they started, by reason (not in SGLang).",
                                ["model_name", "reason"], registry=r)
        self._labels = labels
        self.ttft = hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.itl = hist("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _ITL_BUCKETS)
        self.e2e = hist("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                        _E2E_BUCKETS)
        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queued = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.kv_used = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.kv_usage = gauge("sglang:token_usage", "The token usage.")
        self.kv_total = gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self._last_gen: tuple[float, float] | None = None
        # Speculative decoding: tokens per verification step, of the whole run (SGLang's gauge)
        # and per finished request that verified.
        self.spec_accept_length = gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.")
        self.spec_accept_length_per_req = hist(
            "sglang:spec_accept_length_per_request", "Histogram of each finished request's tokens per verification "
            "step in speculative decoding (not in SGLang).", _ACCEPT_BUCKETS)
        self.spec_verify_steps = counter("sglang:spec_verify_steps_total", "Verification steps of requests' drafts (not in SGLang).")
        self.spec_draft_tokens = counter("sglang:spec_draft_tokens_total", "Draft tokens verified (not in SGLang).")
        self.spec_accepted_tokens = counter("sglang:spec_accepted_tokens_total", "Draft tokens accepted (not in SGLang).")
        self._last_spec = (0, 0, 0)

    def refused(self, reason: str) -> None:
        self._refused.labels(**self._labels, reason=reason).inc()

    def update_from_stats(self, stats: dict[str, Any], now: float) -> None:
        total = stats.get("total_tokens") or 0
        self.running.set(stats.get("running", 0))
        self.queued.set(stats.get("waiting", 0))
        self.kv_total.set(total)
        if total:
            in_use = total - stats.get("free_tokens", 0) - stats.get("evictable_tokens", 0)
            self.kv_used.set(in_use)
            self.kv_usage.set(in_use / total)
        prompt = stats.get("prefill_tokens", 0) + stats.get("cached_prompt_tokens", 0)
        if prompt:
            self.cache_hit_rate.set(stats.get("cached_prompt_tokens", 0) / prompt)
        generated = float(stats.get("decode_tokens", 0))
        if self._last_gen is not None and now > self._last_gen[0]:
            self.gen_throughput.set(max(0.0, generated - self._last_gen[1]) / (now - self._last_gen[0]))
        self._last_gen = (now, generated)
        spec = (stats.get("spec_verify_steps", 0), stats.get("spec_drafted_tokens", 0), stats.get("spec_accepted_tokens", 0))
        if spec[0]:
            self.spec_accept_length.set(1 + spec[2] / spec[0])
        # The scheduler's totals are cumulative: the counters advance by what is new since.
        for c, new, old in zip((self.spec_verify_steps, self.spec_draft_tokens, self.spec_accepted_tokens),
                               spec, self._last_spec):
            if new > old:
                c.inc(new - old)
        self._last_spec = spec

    def render(self) -> bytes:
        return generate_latest(self.registry)
