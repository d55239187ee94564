"""Engine metrics, defined in one place, with vLLM's names, types, buckets and labels.

Served under the ``mlxd:`` prefix by default, or ``vllm:`` so that dashboards
and autoscalers written for vLLM work unchanged; under ``vllm:`` the deprecated
names vLLM's example dashboard still reads are served too. Each Engine has its
own registry (several engines may live in one test process). Every series
carries vLLM's ``model_name`` and ``engine`` labels (one engine: "0").
tests/engined/vllm_metrics.json is vLLM's table these are checked against.

Over 400 lines because every series vLLM defines is declared here, under its names, buckets and
labels, beside the periodic log line read from the same counters: metrics are defined in one place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest,
)

from mlxd.engined.kv.disk_store import DiskTotals
from mlxd.engined.request import Request
from mlxd.shared.config import EngineConfig
from mlxd.shared.protocol import EngineStats

log = logging.getLogger("mlxd.engine")

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
# The engine label's value: one engine per process (vLLM numbers its data-parallel engines).
ENGINE_INDEX = "0"


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets of per-request token counts."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


# vLLM's buckets of the n parameter.
N_BUCKETS = [1, 2, 5, 10, 20]


@dataclass
class SpecTotals:
    """Running spec-decode totals for the stats line (the Prometheus counters hold the same)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def _copy(totals: SpecTotals) -> SpecTotals:
    return replace(totals, accepted_per_pos=list(totals.accepted_per_pos))


class EngineMetrics:
    def __init__(self, model_name: str, config: EngineConfig, max_model_len: int,
                 held: Callable[[], EngineStats], disk: DiskTotals | None = None):
        """One engine's series. ``held`` is what the engine holds now (its queues and KV pool): the
        request and KV gauges read it when they are scraped, from the metrics server's thread, so
        that they are current during a step of minutes and not only once it ends (it reads sizes of
        the engine thread's queues, which the GIL keeps whole). cache_config_info is set from the
        start, and the spec-decode series are declared when the engine speculates, as vLLM does.
        ``disk``: the KV disk tier's running totals (kv/disk_store.py), when it is on (its series are
        served either way, at zero without it, so that dashboards find them)."""
        prefix = config.metrics_prefix
        if prefix not in ("mlxd", "vllm"):
            raise ValueError("metrics prefix must be 'mlxd' or 'vllm'")
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
        self.model_name = model_name
        self.prefix = prefix
        labels = ["model_name", "engine"]
        self._labels = labels
        values = (model_name, ENGINE_INDEX)
        self._values = values
        # vLLM's deprecated names (its example dashboard reads them), only where vLLM's names are served.
        deprecated = prefix == "vllm"

        def name(n):
            return f"{prefix}:{n}"

        def gauge(n, doc):
            return Gauge(name(n), doc, labels, registry=self.registry).labels(*values)

        def counter(n, doc):
            return Counter(name(n), doc, labels, registry=self.registry).labels(*values)

        def histogram(n, doc, buckets):
            return Histogram(name(n), doc, labels, buckets=buckets, registry=self.registry).labels(*values)

        self._name, self._counter = name, counter
        # What the gauges read (``serve`` may name another source).
        self._held = held
        gauge("num_requests_running", "Number of requests in model execution batches.").set_function(
            lambda: self._held().num_running)
        gauge("num_requests_waiting", "Number of requests waiting to be processed.").set_function(
            lambda: self._held().num_waiting)
        gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").set_function(
            lambda: _kv_usage(self._held()))
        if deprecated:
            gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use "
                  "vllm:kv_cache_usage_perc.").set_function(lambda: _kv_usage(self._held()))
        gauge("kv_cache_blocks_total", "KV-cache blocks in the fixed pool.").set_function(
            lambda: self._held().num_total_blocks)
        gauge("kv_cache_blocks_free", "KV-cache blocks free (cached prefixes included).").set_function(
            lambda: self._held().num_free_blocks)
        self.mlx_active = gauge("mlx_active_memory_bytes", "Memory held by live MLX arrays.")
        self.mlx_cache = gauge("mlx_cache_memory_bytes", "Memory in MLX's buffer cache.")
        self.mlx_peak = gauge("mlx_peak_memory_bytes", "Peak MLX memory since start.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                                              "queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.gpu_prefix = (counter("gpu_prefix_cache_queries", "DEPRECATED: use vllm:prefix_cache_queries."),
                           counter("gpu_prefix_cache_hits", "DEPRECATED: use vllm:prefix_cache_hits.")) \
            if deprecated else None
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter(name("request_success"), "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=self.registry)
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot_deprecated = histogram("time_per_output_token_seconds", "Histogram of time per output token "
                                         "in seconds. DEPRECATED: use vllm:inter_token_latency_seconds.",
                                         ITL_BUCKETS) if deprecated else None
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                                                             "request.", REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Histogram of time spent in RUNNING phase "
                                                                     "for request.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                                                                 "request.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                                                               "request.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per "
                                                                    "engine_step.", TOKEN_BUCKETS)
        self.step_time = histogram("step_duration_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        # The per-request token histograms, whose buckets follow max_model_len as vLLM's do.
        sizes = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", sizes)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", sizes)
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", sizes)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", sizes)
        app_tokens = Counter(name("app_generation_tokens"), "Generated tokens by app.",
                             labels + ["app"], registry=self.registry)
        app_requests = Counter(name("app_requests"), "Finished requests by app.",
                               labels + ["app"], registry=self.registry)
        self._app_tokens = lambda app: app_tokens.labels(*values, app)  # noqa: E731
        self._app_requests = lambda app: app_requests.labels(*values, app)  # noqa: E731
        self._apps: set[str] = set()
        pooled = Counter(name("pooling_requests"), "Finished prefill-only requests (embeddings, scores) by task.",
                         labels + ["task"], registry=self.registry)
        self.pooled_requests = {t: pooled.labels(*values, t) for t in ("embed", "score")}
        self._prefix_seen = (0, 0)
        self._preemptions_seen = 0
        self.disk, self._disk_seen = disk, DiskTotals()
        disk = disk or DiskTotals()
        self._disk_counters = {
            "hit_blocks": counter("kv_disk_cache_hit_blocks", "Prefix cache blocks read back from the KV disk "
                                                              "cache instead of computed."),
            "bytes_read": counter("kv_disk_cache_read_bytes", "Bytes read from the KV disk cache."),
            "bytes_written": counter("kv_disk_cache_written_bytes", "Bytes written to the KV disk cache."),
            "evicted_blocks": counter("kv_disk_cache_evicted_blocks", "Blocks deleted from the KV disk cache "
                                                                      "to keep its budget."),
            "discarded_files": counter("kv_disk_cache_discarded_files", "KV disk cache files found damaged "
                                                                        "or foreign, deleted, not served."),
        }
        gauge("kv_disk_cache_bytes", "Bytes the KV disk cache holds.").set_function(lambda: disk.bytes)
        gauge("kv_disk_cache_blocks", "Blocks the KV disk cache holds.").set_function(lambda: disk.blocks)
        self._spec = None
        self._lora_info = None
        self._lora_seen: tuple | None = None
        # Running totals for the periodic stats line (StatsLog): prompt tokens prefilled (of
        # which found in the prefix cache) and tokens generated.
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.total_generation_tokens = 0
        self.spec: SpecTotals | None = None  # set when the engine speculates

        info = Gauge(self._name("cache_config_info"), "Information of the LLMEngine CacheConfig",
                     ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                      "num_gpu_blocks", "engine"], registry=self.registry)
        info.labels(str(config.block_size), "auto", str(config.enable_prefix_caching),
                    str(config.gpu_memory_utilization), str(held().num_total_blocks), ENGINE_INDEX).set(1)
        spec = config.speculative
        if spec is not None:
            per_pos = self._spec_series()[3]
            for pos in range(spec.num_speculative_tokens):  # every position's series from the start, as vLLM
                per_pos(pos)
            self.spec = SpecTotals(accepted_per_pos=[0] * spec.num_speculative_tokens)
        if config.enable_lora:
            self._lora_info = Gauge(self._name("lora_requests_info"), "Running stats on lora requests.",
                                    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                    registry=self.registry)
            self.on_lora(config.max_loras, [], [])
        self.on_step(0, 0.0, held())

    def on_lora(self, max_loras: int, running: list[str], waiting: list[str]) -> None:
        """vLLM's lora_requests_info: one series, labelled with the adapters running and waiting (comma
        separated), valued at the time they last changed. Nothing where adapters are off."""
        labels = (str(max_loras), ",".join(waiting), ",".join(running))
        if self._lora_info is None or labels == self._lora_seen:
            return
        self._lora_seen = labels
        self._lora_info.clear()  # one series: the state now, not every state seen since the start
        self._lora_info.labels(*labels).set_to_current_time()

    def _spec_series(self):
        """The spec-decode counters, declared at the first use: vLLM serves them only when it speculates."""
        if self._spec is None:
            counter = self._counter
            per_pos = Counter(self._name("spec_decode_num_accepted_tokens_per_pos"),
                              "Accepted draft tokens by position.", self._labels + ["position"],
                              registry=self.registry)
            self._spec = (counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
                          counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
                          counter("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                          lambda pos: per_pos.labels(*self._values, str(pos)))
        return self._spec

    @property
    def spec_drafts(self):
        return self._spec_series()[0]

    @property
    def spec_draft_tokens(self):
        return self._spec_series()[1]

    @property
    def spec_accepted(self):
        return self._spec_series()[2]

    def serve(self, port: int, host: str = "127.0.0.1", held: Callable[[], EngineStats] | None = None):
        """Serve /metrics over HTTP in a background thread; returns (server, thread).

        ``held`` (callable from that thread), when given, is what the gauges read instead of the
        engine's own: the daemon's, which counts the requests it received but has not taken in
        yet (its inbox, read between steps) as waiting.

        Always the classic text format: prometheus-client's OpenMetrics encoder
        (chosen when Prometheus asks for it) rewrites the ``:`` of sample names
        to ``_``, which would break every query and dashboard written for
        ``vllm:``/``mlxd:`` names.
        """
        registry = self.registry
        if held is not None:
            self._held = held

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
        """After every step: MLX's memory, and counters from the growth of the engine's stats."""
        self.mlx_active.set(mx.get_active_memory())
        self.mlx_cache.set(mx.get_cache_memory())
        self.mlx_peak.set(mx.get_peak_memory())
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        if self.gpu_prefix is not None:
            self.gpu_prefix[0].inc(queries - self._prefix_seen[0])
            self.gpu_prefix[1].inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        if self.disk is not None:
            for field_name, series in self._disk_counters.items():
                now = getattr(self.disk, field_name)
                series.inc(now - getattr(self._disk_seen, field_name))
                setattr(self._disk_seen, field_name, now)
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
            self.step_time.observe(duration)

    def on_tokens(self, counted: list[tuple[Request, int]], now: float) -> None:
        """After a step appended ``count`` tokens to each ``(req, count)`` (more than one where drafts were
        accepted). The counters move once a step (once per app), the latencies once per request: the step's
        host time at 64 decoding requests is what a GPU waits on.

        A request's first token is the end of its prefill: the prompt's tokens count then, as in vLLM (a
        request aborted before it is prefilled adds none).
        """
        total, by_app = 0, {}
        for req, count in counted:
            total += count
            by_app[req.app] = by_app.get(req.app, 0) + count
            if req.first_token_time is None:
                req.first_token_time = now
                self.ttft.observe(now - req.arrival_time)
                self.prompt_tokens.inc(req.num_prompt_tokens)
                self.total_prompt_tokens += req.num_prompt_tokens
                self.total_cached_tokens += req.num_cached_tokens
            else:
                self.itl.observe(now - req.last_token_time)
                if self.tpot_deprecated is not None:
                    self.tpot_deprecated.observe(now - req.last_token_time)
            req.last_token_time = now
        if total:
            self.generation_tokens.inc(total)
            self.total_generation_tokens += total
        for app, count in by_app.items():
            self._app_tokens(self._app_label(app)).inc(count)

    def on_spec(self, drafted: list[int], accepted: list[int]) -> None:
        """After verification: draft lengths and accepted counts, one per speculating request."""
        drafts, draft_tokens, accepted_tokens, per_pos = self._spec_series()
        drafts.inc(len(drafted))
        draft_tokens.inc(sum(drafted))
        accepted_tokens.inc(sum(accepted))
        for n in accepted:
            for pos in range(n):
                per_pos(pos).inc()
        totals = self.spec
        if totals is not None:
            totals.drafts += len(drafted)
            totals.draft_tokens += sum(drafted)
            totals.accepted += sum(accepted)
            for n in accepted:
                for pos in range(n):
                    totals.accepted_per_pos[pos] += 1

    def on_pooled(self, req: Request, now: float) -> None:
        """After a step finished an embed or score request's prompt (its result is its only output):
        its prompt tokens count as prefilled, as a generation's do at its first token."""
        self.pooled_requests[req.task].inc()
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.total_prompt_tokens += req.num_prompt_tokens
        self.total_cached_tokens += req.num_cached_tokens

    def on_finish(self, req: Request, now: float) -> None:
        self.success[req.finish_reason].inc()
        self._app_requests(self._app_label(req.app)).inc()
        self.e2e.observe(now - req.arrival_time)
        generated = req.num_output_tokens
        self.request_prompt_tokens.observe(req.num_prompt_tokens)
        self.request_generation_tokens.observe(generated)
        self.params_max_tokens.observe(req.params.max_tokens)
        self.request_max_generation_tokens.observe(req.params.max_tokens)
        # The gateway sends each of n choices as its own request; one of them carries the n.
        if req.params_n:
            self.params_n.observe(req.params_n)
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)
            self.inference.observe(now - req.first_scheduled_time)
            if req.first_token_time is not None:
                self.prefill.observe(req.first_token_time - req.first_scheduled_time)
                self.decode.observe(now - req.first_token_time)
        if req.first_token_time is not None:
            # vLLM's mean time per output token: the decode's time over the tokens after the first.
            self.request_tpot.observe((req.last_token_time - req.first_token_time) / (generated - 1)
                                      if generated > 1 else 0.0)


def _kv_usage(stats: EngineStats) -> float:
    # An encoder engine has no KV pool (0 blocks): nothing of it is in use.
    return 1.0 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0


class StatsLog:
    """vLLM's periodic stats line: throughput since the last line, the batch, KV usage, prefix hits;
    and, when drafts were verified since, vLLM's SpecDecoding line: mean acceptance length (the
    bonus token included), accepted and drafted tokens, per-position and overall acceptance rates.

    INFO while there is work (this interval or the one before it), DEBUG when idle, as in vLLM.
    """

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics
        self._last_at: float | None = None
        self._last_totals = (0, 0, 0)
        self._last_spec = _copy(metrics.spec) if metrics.spec is not None else None
        self._was_busy = False

    def maybe_log(self, now: float, stats, interval: float) -> str | None:
        """Write the line if ``interval`` seconds passed since the last; returns it (None if not due)."""
        if self._last_at is None:
            self._last_at = now
            return None
        elapsed = now - self._last_at
        if elapsed < interval:
            return None
        m = self.metrics
        totals = (m.total_prompt_tokens, m.total_cached_tokens, m.total_generation_tokens)
        prompt, cached, generated = (a - b for a, b in zip(totals, self._last_totals))
        self._last_at, self._last_totals = now, totals
        # Prompt throughput counts what was computed: tokens found in the prefix cache were not.
        prompt_tps, gen_tps = (prompt - cached) / elapsed, generated / elapsed
        busy = bool(prompt or generated)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        usage = _kv_usage(stats)
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        line = (f"Engine 000: Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
                f"{gen_tps:.1f} tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"GPU KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%")
        disk = m.disk
        if disk is not None:
            line += (f", KV disk cache: {disk.blocks} blocks, {disk.bytes / 2**30:.2f} GiB, "
                     f"{disk.hit_blocks} blocks read back")
        log.log(level, "%s", line)
        spec = self._spec_line(elapsed)
        if spec:
            log.log(level, "%s", spec)
            line += "\n" + spec
        return line

    def _spec_line(self, elapsed: float) -> str | None:
        now, before = self.metrics.spec, self._last_spec
        if now is None:
            return None
        self._last_spec = _copy(now)
        drafts, drafted, accepted = now.drafts - before.drafts, now.draft_tokens - before.draft_tokens, \
            now.accepted - before.accepted
        if not drafts:
            return None
        rates = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in zip(now.accepted_per_pos, before.accepted_per_pos))
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted throughput: "
                f"{accepted / elapsed:.2f} tokens/s, Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {accepted / drafted * 100:.1f}%")
