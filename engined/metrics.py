"""Engine metrics, defined in one place, with vLLM's names, types, buckets and ``model_name`` label.

Served under the ``mlxd:`` prefix by default, or ``vllm:`` so that dashboards
and autoscalers written for vLLM work unchanged. Each Engine has its own
registry (several engines may live in one test process).
"""

from __future__ import annotations

import mlx.core as mx
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest,
)

from engined.request import Request

# vLLM's buckets.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
# Per-app series stay bounded: apps past this many share the label "other".
MAX_APP_LABELS = 16


class EngineMetrics:
    def __init__(self, model_name: str, prefix: str = "mlxd"):
        if prefix not in ("mlxd", "vllm"):
            raise ValueError("metrics prefix must be 'mlxd' or 'vllm'")
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
        self.model_name = model_name
        labels = ["model_name"]

        def name(n):
            return f"{prefix}:{n}"

        def gauge(n, doc):
            return Gauge(name(n), doc, labels, registry=self.registry).labels(model_name)

        def counter(n, doc):
            return Counter(name(n), doc, labels, registry=self.registry).labels(model_name)

        def histogram(n, doc, buckets):
            return Histogram(name(n), doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV-cache blocks in the fixed pool.")
        self.kv_blocks_free = gauge("kv_cache_blocks_free", "KV-cache blocks free (cached prefixes included).")
        self.mlx_active = gauge("mlx_active_memory_bytes", "Memory held by live MLX arrays.")
        self.mlx_cache = gauge("mlx_cache_memory_bytes", "Memory in MLX's buffer cache.")
        self.mlx_peak = gauge("mlx_peak_memory_bytes", "Peak MLX memory since start.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (to be recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter(name("request_success"), "Finished requests by finish reason.",
                          labels + ["finished_reason"], registry=self.registry)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before first scheduled.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.step_time = histogram("step_duration_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft windows verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        per_pos = Counter(name("spec_decode_num_accepted_tokens_per_pos"), "Accepted draft tokens by position.",
                          labels + ["position"], registry=self.registry)
        self.spec_accepted_per_pos = lambda pos: per_pos.labels(model_name, str(pos))  # noqa: E731
        app_tokens = Counter(name("app_generation_tokens"), "Generated tokens by app.",
                             labels + ["app"], registry=self.registry)
        app_requests = Counter(name("app_requests"), "Finished requests by app.",
                               labels + ["app"], registry=self.registry)
        self._app_tokens = lambda app: app_tokens.labels(model_name, app)  # noqa: E731
        self._app_requests = lambda app: app_requests.labels(model_name, app)  # noqa: E731
        self._apps: set[str] = set()
        self._prefix_seen = (0, 0)
        self._preemptions_seen = 0

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Serve /metrics over HTTP in a background thread; returns (server, thread).

        Always the classic text format: prometheus-client's OpenMetrics encoder
        (chosen when Prometheus asks for it) rewrites the ``:`` of sample names
        to ``_``, which would break every query and dashboard written for
        ``vllm:``/``mlxd:`` names.
        """
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes every few seconds: keep the engine's log quiet
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        return server, thread

    def _app_label(self, app: str) -> str:
        app = app or "default"
        if app not in self._apps:
            if len(self._apps) >= MAX_APP_LABELS:
                return "other"
            self._apps.add(app)
        return app

    def on_step(self, num_tokens: int, duration: float, stats) -> None:
        """After every step: gauges from the engine's stats, counters from their growth."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_total.set(stats.num_total_blocks)
        self.kv_blocks_free.set(stats.num_free_blocks)
        self.kv_usage.set(1.0 - stats.num_free_blocks / max(stats.num_total_blocks, 1))
        self.mlx_active.set(mx.get_active_memory())
        self.mlx_cache.set(mx.get_cache_memory())
        self.mlx_peak.set(mx.get_peak_memory())
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
            self.step_time.observe(duration)

    def on_token(self, req: Request, now: float, count: int = 1) -> None:
        """After a step appended ``count`` tokens to ``req`` (more than one when drafts were accepted)."""
        self.generation_tokens.inc(count)
        self._app_tokens(self._app_label(req.app)).inc(count)
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def on_spec(self, drafted: list[int], accepted: list[int]) -> None:
        """After verification: draft lengths and accepted counts, one per speculating request."""
        self.spec_drafts.inc(len(drafted))
        self.spec_draft_tokens.inc(sum(drafted))
        self.spec_accepted.inc(sum(accepted))
        for n in accepted:
            for pos in range(n):
                self.spec_accepted_per_pos(pos).inc()

    def on_finish(self, req: Request, now: float) -> None:
        self.success[req.finish_reason].inc()
        self._app_requests(self._app_label(req.app)).inc()
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.e2e.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)
            if req.first_token_time is not None:
                self.prefill.observe(req.first_token_time - req.first_scheduled_time)
                self.decode.observe(now - req.first_token_time)
