"""Prometheus metrics of a served engine, named like vLLM's (`vllm:` → `specdec:`).

Each app owns its registry (no process-global collectors), so tests can run many servers. Request
counters and latency histograms move when a request finishes; gauges are read at each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.engine.engine import Engine
from specdec.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        name = ["model_name"]

        def counter(metric: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(metric, text, [*name, *labels], registry=self.registry)

        def gauge(metric: str, text: str) -> Gauge:
            return Gauge(metric, text, name, registry=self.registry)

        def histogram(metric: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, text, name, buckets=buckets, registry=self.registry)

        self.num_drafts = counter("specdec:spec_decode_num_drafts", "Speculative steps (drafts verified).")
        self.num_draft_tokens = counter("specdec:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ("position",))
        self.draft_time = counter("specdec:spec_decode_draft_time_seconds", "Time spent drafting.")
        self.verify_time = counter("specdec:spec_decode_verify_time_seconds", "Time spent in verify forwards.")
        self.prompt_tokens = counter("specdec:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("specdec:generation_tokens", "Generated tokens of finished requests.")
        self.request_success = counter("specdec:request_success", "Finished requests.", ("finished_reason",))
        self.ttft = histogram("specdec:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("specdec:time_per_output_token_seconds", "Mean time per output token after the first.",
                              _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("specdec:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.running = gauge("specdec:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("specdec:num_requests_waiting", "Sequences waiting for a KV slot or a batch seat.")
        self.kv_usage = gauge("specdec:kv_cache_usage_perc", "Share of the target's KV slots in use (0–1).")

    def request_finished(self, output: RequestOutput) -> None:
        m, label = output.metrics, self.model_name
        self.prompt_tokens.labels(label).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(label).inc(m.num_output_tokens)
        for choice in output.outputs:
            self.request_success.labels(label, choice.finish_reason or "abort").inc()
        for metric, value in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s)):
            if value is not None:
                metric.labels(label).observe(value)
        spec = m.speculative_decoding
        if spec:
            self.num_drafts.labels(label).inc(spec["num_spec_steps"])
            self.num_draft_tokens.labels(label).inc(spec["num_draft_tokens"])
            self.num_accepted_tokens.labels(label).inc(spec["num_accepted_tokens"])
            for position, count in enumerate(spec["acceptance_histogram"]):
                self.accepted_per_pos.labels(label, str(position)).inc(count)
            self.draft_time.labels(label).inc(spec["draft_time_s"])
            self.verify_time.labels(label).inc(spec["verify_time_s"])

    def read_engine(self, engine: Engine) -> None:
        label = self.model_name
        self.running.labels(label).set(len(engine.running))
        self.waiting.labels(label).set(len(engine.waiting))
        cache = engine.cache
        self.kv_usage.labels(label).set(1 - cache.num_free_slots / cache.num_slots)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
