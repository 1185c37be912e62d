"""The server's ``/metrics``: Prometheus text (``prometheus_client``) under vLLM's metric names, labelled with
``model_name`` as vLLM labels them.

Counted as outputs arrive (``ServerMetrics.observe``, on the event loop): ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total`` (by ``finished_reason``), and the histograms
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds`` (the gap between a request's successive
outputs, per output token: vLLM v0's name; V1 calls it ``vllm:inter_token_latency_seconds``) and
``vllm:e2e_request_latency_seconds``. Read from the engine at each scrape: ``vllm:num_requests_running`` /
``_waiting`` / ``_swapped`` (the scheduler's queues, §4.5), ``vllm:gpu_cache_usage_perc`` and
``vllm:cpu_cache_usage_perc`` (the used fraction of the device / CPU swap block pools, 0 to 1 as in vLLM), and
``vllm:num_preemptions_total``. Each server has its own registry, so that several can live in one process (tests).
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

#: vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class _EngineState:
    """A collector that reads the engine's queues, cache use and preemptions at scrape time."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine, self.label = engine, model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.label], value)
        return g

    def collect(self):
        s, kv = self.engine.scheduler, self.engine.kv
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", len(s.running))
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(s.waiting))
        yield self._gauge("vllm:num_requests_swapped", "Requests swapped out to the CPU.", len(s.swapped))
        device, _, cpu = kv.cache_layout()
        yield self._gauge("vllm:gpu_cache_usage_perc", "Used fraction of the device KV blocks (1 = full).",
                          kv.num_used_gpu_blocks / device if device else 0.0)
        pool = getattr(kv, "cpu", None)  # the paged manager's CPU BlockPool (a contiguous manager has no swap)
        cpu_free = pool.num_free if pool is not None else cpu
        yield self._gauge("vllm:cpu_cache_usage_perc", "Used fraction of the CPU swap blocks (1 = full).",
                          (cpu - cpu_free) / cpu if cpu else 0.0)
        c = CounterMetricFamily("vllm:num_preemptions", "Preemptions since the server started.",
                                labels=["model_name"])
        c.add_metric([self.label], sum(s.num_preemptions.values()))
        yield c


class ServerMetrics:
    """The Prometheus registry of one server, fed with every output (``AsyncEngine``'s observer)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.label = model_name
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the finished requests.", **kw)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", **kw)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, **kw)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, **kw)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, **kw)
        self.registry.register(_EngineState(engine, model_name))
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens counted, time of its last output)

    def observe(self, out: RequestOutput) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        now = time.perf_counter()  # the engine's clock (LLMEngine.now)
        counted, last = self._seen.get(out.request_id, (0, None))
        new = tokens - counted
        if new > 0:
            self.generation_tokens.labels(self.label).inc(new)
            if last is None:
                first = out.metrics.first_token_time or now
                self.ttft.labels(self.label).observe(max(0.0, first - out.metrics.arrival_time))
            else:
                per_token = (now - last) / max(1, new // max(1, len(out.outputs)))
                self.tpot.labels(self.label).observe(per_token)
            self._seen[out.request_id] = (tokens, now)
        if out.finished:
            self._seen.pop(out.request_id, None)
            self.prompt_tokens.labels(self.label).inc(len(out.prompt_token_ids))
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "error" if out.error else "stop")
            self.success.labels(self.label, reason).inc()
            end = out.metrics.finish_time or now
            self.e2e.labels(self.label).observe(max(0.0, end - out.metrics.arrival_time))

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
