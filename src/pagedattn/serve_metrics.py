"""The server's ``/metrics``: Prometheus text (``prometheus_client``) under the metric names, label sets and buckets
of vLLM 0.32 (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; ``vllm/v1/metrics/buckets.py``), the release
``make vllm-venv`` installs, so that a dashboard built for it finds ours. Every metric is labelled with
``model_name`` and ``engine`` (``"0"``: one engine), as vLLM labels them; ``METRICS`` lists the names.

Counted as outputs arrive (``ServerMetrics.observe``, on the event loop): ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total`` (by ``finished_reason``), the latency histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (the gap between a request's successive
steps), ``vllm:e2e_request_latency_seconds`` and the phases of a finished request (``request_queue_time``: arrival to
its first scheduling; ``request_prefill_time``: to its first token; ``request_decode_time``: first token to the end;
``request_inference_time``: first scheduling to the end; ``request_time_per_output_token``), and its sizes
(``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``, ``vllm:request_params_n``,
``vllm:request_params_max_tokens``, ``vllm:request_max_num_generation_tokens``). A request of ``n`` samples is one
request here (vLLM 0.32 counts its samples as child requests).

Read from the engine at each scrape: ``vllm:num_requests_running`` / ``_waiting`` (the scheduler's queues, §4.5),
``vllm:kv_cache_usage_perc`` (the used fraction of the device block pool, 0 to 1), ``vllm:num_preemptions_total``,
and ``vllm:prefix_cache_queries_total`` / ``_hits_total`` (in tokens: the prefix cache's block lookups times the
block size). vLLM v0's ``gpu_cache_usage_perc``, ``time_per_output_token_seconds`` and ``num_requests_swapped`` are
gone from 0.32; the paper's swapping (§4.5), which 0.32 no longer has, is reported under our own prefix:
``pagedattn:num_requests_swapped`` and ``pagedattn:cpu_cache_usage_perc``. Each server has its own registry, so
that several can live in one process (tests).
"""
from __future__ import annotations

import time
from typing import Any

from pagedattn.engine import LLMEngine
from pagedattn.extras import missing_extra
from pagedattn.sequence import RequestOutput

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as e:  # the server's extra
    missing_extra("serve", "pagedattn.serve_metrics", e)

#: vLLM 0.32's bucket families (seconds; ``vllm/v1/metrics/buckets.py``)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
LABELS = ["model_name", "engine"]

#: every metric family ``/metrics`` exposes (Prometheus adds ``_total`` to counters, ``_bucket``/``_sum``/``_count``
#: to histograms); all but the last two are vLLM 0.32's names
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
           "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
           "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
           "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
           "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
           "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
           "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
           "pagedattn:num_requests_swapped", "pagedattn:cpu_cache_usage_perc")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's ``request_tokens`` family: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineState:
    """A collector that reads the engine's queues, cache use, preemptions and prefix cache at scrape time."""

    def __init__(self, engine: LLMEngine, labels: list[str]) -> None:
        self.engine, self.labels = engine, labels

    def _one(self, family, value: float):
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        s, kv = self.engine.scheduler, self.engine.kv
        gauge = lambda name, doc, v: self._one(GaugeMetricFamily(name, doc, labels=LABELS), v)  # noqa: E731
        counter = lambda name, doc, v: self._one(CounterMetricFamily(name, doc, labels=LABELS), v)  # noqa: E731
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(s.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(s.waiting))
        device, block, cpu = kv.cache_layout()
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    kv.num_used_gpu_blocks / device if device else 0.0)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      sum(s.num_preemptions.values()))
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      getattr(kv, "prefix_queries", 0) * block)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      getattr(kv, "prefix_hits", 0) * block)
        yield gauge("pagedattn:num_requests_swapped", "Requests swapped out to the CPU (paper §4.5).", len(s.swapped))
        pool = getattr(kv, "cpu", None)  # the paged manager's CPU BlockPool (a contiguous manager has no swap)
        cpu_free = pool.num_free if pool is not None else cpu
        yield gauge("pagedattn:cpu_cache_usage_perc", "Used fraction of the CPU swap blocks (1 = full).",
                    (cpu - cpu_free) / cpu if cpu else 0.0)


class ServerMetrics:
    """The Prometheus registry of one server, fed with every output (``AsyncEngine``'s observer)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = [model_name, "0"]
        kw: dict[str, Any] = {"labelnames": LABELS, "registry": self.registry}
        tokens = request_tokens_buckets(engine.max_model_len)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, buckets=buckets, **kw).labels(*self.labels)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     **kw).labels(*self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         **kw).labels(*self.labels)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labelnames=LABELS + ["finished_reason"], registry=self.registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.phases = {phase: histogram(f"vllm:{name}", doc, REQUEST_LATENCY_BUCKETS) for phase, name, doc in (
            ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("queue", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            ("inference", "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
            ("prefill", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."))}
        self.sizes = {size: histogram(f"vllm:{name}", doc, buckets) for size, name, doc, buckets in (
            ("prompt", "request_prompt_tokens", "Number of prefill tokens processed.", tokens),
            ("generation", "request_generation_tokens", "Number of generation tokens processed.", tokens),
            ("max_generation", "request_max_num_generation_tokens",
             "Histogram of maximum number of requested generation tokens.", tokens),
            ("n", "request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS),
            ("max_tokens", "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens))}
        self.registry.register(_EngineState(engine, self.labels))
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens counted, time of its last output)

    def observe(self, out: RequestOutput) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        now = time.perf_counter()  # the engine's clock (LLMEngine.now)
        m = out.metrics
        counted, last = self._seen.get(out.request_id, (0, None))
        new = tokens - counted
        if new > 0:
            self.generation_tokens.inc(new)
            if last is None:  # its prefill is done
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(max(0.0, (m.first_token_time or now) - m.arrival_time))
            else:
                self.itl.observe(now - last)
            self._seen[out.request_id] = (tokens, now)
        if out.finished:
            self._finished(out, tokens, now)

    def _finished(self, out: RequestOutput, tokens: int, now: float) -> None:
        self._seen.pop(out.request_id, None)
        m = out.metrics
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "error" if out.error else "stop")
        self.success.labels(*self.labels, reason).inc()
        end = m.finish_time or now
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        first = m.first_token_time if m.first_token_time is not None else end
        for phase, seconds in (("e2e", end - m.arrival_time), ("queue", scheduled - m.arrival_time),
                               ("inference", end - scheduled), ("prefill", first - scheduled),
                               ("decode", end - first)):
            self.phases[phase].observe(max(0.0, seconds))
        per_sample = max((len(c.token_ids) for c in out.outputs), default=0)
        if per_sample > 1:
            self.tpot.observe(max(0.0, end - first) / (per_sample - 1))
        self.sizes["prompt"].observe(len(out.prompt_token_ids))
        self.sizes["generation"].observe(tokens)
        self.sizes["max_generation"].observe(per_sample)

    def observe_params(self, n: int, max_tokens: int) -> None:
        """A request's ``n`` and ``max_tokens`` as it arrives (vLLM's ``request_params_*``)."""
        self.sizes["n"].observe(n)
        self.sizes["max_tokens"].observe(max_tokens)

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
