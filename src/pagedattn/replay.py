"""Replay requests against any OpenAI-compatible endpoint and report what vLLM's ``benchmark_serving`` reports.

``replay()`` sends each request at its arrival time (seconds from the start), streaming and greedy, with
``max_tokens`` its output length and ``ignore_eos`` (an extra field that vLLM's server and ours accept;
``ignore_eos=False`` leaves it out), to ``/v1/completions`` or ``/v1/chat/completions`` (``endpoint="chat"``, text
prompts only). A request's prompt is text, token ids, or (``None``) random token ids of its prompt length (any model,
no tokenizer needed). Every chunk is timed.

Like ``benchmark_serving``, ``summarize`` reports over the completed requests: total input and output tokens; request,
output-token and total-token throughput; time to first token (TTFT), time per output token after the first (TPOT),
the inter-token latency of every streamed chunk (ITL) and end-to-end latency (E2EL), each with mean, median, standard
deviation and percentiles; and goodput, the completed requests per second that meet every SLO target (``--slo
ttft:500 tpot:50``, in ms; vLLM calls the option ``--goodput``). It adds the paper's normalised latency (E2EL / output
tokens, §6.1). Arrivals may follow a gamma process (``gamma_arrivals``: shape ``burstiness``, mean gap ``1 / rate``;
1 is Poisson, smaller is burstier, as vLLM's ``--burstiness``); ``max_concurrency`` caps the requests in flight (a
request waits for a free slot, and is timed from when it is sent). A time limit cancels what is still in flight.

Two command lines share these options (``add_arguments``) and the run (``run``: summary printed, per-request CSV with
``--out``, JSON result with ``--result-file``):
- ``python -m pagedattn.replay --requests trace.jsonl --url ...`` replays a Mooncake-style JSONL (``read_mooncake``:
  ``timestamp`` in ms, ``input_length``, ``output_length``, optionally ``text``), at its own timestamps or re-timed
  with ``--rate`` and ``--burstiness``;
- ``python -m pagedattn.repro.experiments.replay --trace sharegpt --rate 2 ...`` replays the project's traces (the lengths and
  Poisson arrivals the simulator replays, §6.1) or real ShareGPT text (``--prompts sharegpt``).
Layering (issue 49): this module is an entry point and imports no research code (``pagedattn.repro``); the
project's traces and the ShareGPT data set are read by the research tier's command line, which calls this one.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from pagedattn.extras import missing_extra

#: The latency metrics of the summary, as ``benchmark_serving`` names them, plus the paper's normalised latency.
METRICS = ("ttft", "tpot", "itl", "e2el", "nl")
SLO_METRICS = ("ttft", "tpot", "e2el")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class TraceLike(Protocol):
    """What a replayed request needs: ``workloads.TraceRequest`` is one; ``Request`` adds a prompt."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int


@dataclass
class Request:
    """One request to send: at ``arrival_time`` (s from the start), ``prompt`` (token ids or text; ``None``: random
    token ids of ``prompt_len``), ``output_len`` tokens. ``prompt_len`` is the client's count (for text, OPT's GPT-2 BPE);
    the server's ``usage.prompt_tokens`` replaces it once the request completes."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    prompt: list[int] | str | None = None


@dataclass
class RequestRecord:
    """One replayed request; times in seconds from the start of the replay (None: never happened)."""

    request_id: str
    arrival: float  # the trace's arrival time
    prompt_len: int
    max_tokens: int
    sent: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    # "ok" | "error" | "cancelled" (due before the time limit, unfinished at it: in flight or waiting for a slot) |
    # "not_sent" (due after the time limit)
    status: str = "not_sent"
    error: str | None = None
    itl: list[float] = field(default_factory=list)  # the gaps between streamed chunks that carried tokens

    @property
    def latency(self) -> float | None:
        """End-to-end latency (E2EL): from sending the request to its last token."""
        return None if self.last_token is None or self.sent is None else self.last_token - self.sent

    @property
    def normalized_latency(self) -> float | None:
        """Latency / output tokens, in s/token (the paper's normalised latency, §6.1)."""
        return None if self.latency is None or self.tokens == 0 else self.latency / self.tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.sent is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for fewer than two tokens)."""
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)

    def row(self) -> dict:
        """The CSV row: every field but the ITL list (its largest gap instead)."""
        return {**{k: v for k, v in asdict(self).items() if k != "itl"}, "latency": self.latency,
                "normalized_latency": self.normalized_latency, "ttft": self.ttft, "tpot": self.tpot,
                "max_itl": max(self.itl, default=None)}


def base_url(url: str) -> str:
    """``http://host:port`` from a URL given with or without ``/v1``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def random_token_ids(prompt_len: int, vocab_size: int, seed: int) -> list[int]:
    """Random token ids in ``[3, vocab_size)`` for a prompt of ``prompt_len`` (the model only has to see *some*
    tokens; the same draw as ``workloads.synthetic_prompt``, which the in-process replays use)."""
    return np.random.default_rng(seed).integers(3, vocab_size, size=prompt_len).tolist()


def gamma_arrivals(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times (s) with gamma-distributed gaps of shape ``burstiness`` and mean ``1 / rate``, as vLLM's
    ``--burstiness``: 1 is a Poisson process, below 1 burstier, above 1 more regular; ``rate=inf``: all at t = 0."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate ({rate}) and burstiness ({burstiness}) must be > 0")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num_requests)
    return np.cumsum(gaps)


def _tokens_in(chunk: dict) -> int:
    """Tokens a streamed chunk carries: its choices' ``token_ids`` when the server sends them (ours always; vLLM's
    with ``return_token_ids``, which the replayer asks for: without a tokenizer its chunks have empty text), else one
    per choice with text or chat ``delta.content`` (one token per chunk, as servers stream)."""
    n = 0
    for c in chunk.get("choices") or []:
        if c.get("token_ids") is not None:
            n += len(c["token_ids"])
        else:
            n += int(bool(c.get("text") or (c.get("delta") or {}).get("content")))
    return n


def request_body(req, endpoint: str, model: str, vocab_size: int, seed: int, ignore_eos: bool,
                 extra: dict | None = None) -> dict:
    """The JSON body of one streaming, greedy request of ``req.output_len`` tokens to ``endpoint``."""
    prompt = getattr(req, "prompt", None)
    if prompt is None:
        prompt = random_token_ids(req.prompt_len, vocab_size, seed)
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint takes text prompts (--prompts sharegpt), not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body.update(prompt=prompt, return_token_ids=True)
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(extra or {})}


async def send_one(client, rec: RequestRecord, body: dict, t0: float, path: str = ENDPOINTS["completions"]) -> None:
    """Send one streaming request and fill ``rec`` as its chunks arrive."""
    clock = time.perf_counter
    rec.sent = clock() - t0
    usage = None
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.status, rec.error = "error", f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.status, rec.error = "error", str(chunk["error"].get("message"))[:300]
                    return
                usage = chunk.get("usage") or usage
                n = _tokens_in(chunk)
                if n:
                    now = clock() - t0
                    if rec.last_token is None:
                        rec.first_token = now
                    else:
                        rec.itl.append(now - rec.last_token)
                    rec.last_token, rec.tokens = now, rec.tokens + n
        if usage:  # the server's own counts win
            rec.tokens = int(usage.get("completion_tokens", rec.tokens))
            rec.prompt_len = int(usage.get("prompt_tokens", rec.prompt_len))
        rec.status = "ok"
    except Exception as e:  # connection refused / reset: record it, the replay goes on
        rec.status, rec.error = "error", f"{type(e).__name__}: {e}"[:300]


async def fetch_model_card(url: str) -> dict:
    """The first model of ``/v1/models`` (``id``; ours adds ``vocab_size`` and ``max_model_len``)."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url(url), timeout=30) as client:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]


async def replay(url: str, trace: Sequence[TraceLike], model: str, vocab_size: int, ignore_eos: bool = True,
                 time_limit: float | None = None, seed: int = 0, extra: dict | None = None,
                 endpoint: str = "completions", max_concurrency: int | None = None) -> list[RequestRecord]:
    """Send ``trace``'s requests at their arrival times (seconds from now) to ``url``; return one record each.
    A request without a ``prompt`` gets random token ids (request ``i``: seed ``seed * 1_000_003 + i``). With
    ``max_concurrency``, a request due while that many are in flight waits for one to finish. Requests due after
    ``time_limit`` are not sent (status ``not_sent``); those still in flight (or waiting for a slot) at ``time_limit``
    are cancelled (``cancelled``)."""
    import httpx

    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    records = [RequestRecord(r.request_id, r.arrival_time, r.prompt_len, r.output_len) for r in trace]
    bodies = [request_body(r, endpoint, model, vocab_size, seed * 1_000_003 + i, ignore_eos, extra)
              for i, r in enumerate(trace)]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(client, rec: RequestRecord, body: dict, t0: float) -> None:
        if slots is None:
            return await send_one(client, rec, body, t0, ENDPOINTS[endpoint])
        async with slots:
            await send_one(client, rec, body, t0, ENDPOINTS[endpoint])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url(url), timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for r, rec, body in zip(trace, records, bodies):
            if time_limit is not None and r.arrival_time >= time_limit:
                break
            await asyncio.sleep(max(0.0, r.arrival_time - (time.perf_counter() - t0)))
            rec.status = "cancelled"  # until it finishes
            tasks.append(asyncio.create_task(one(client, rec, body, t0)))
        if tasks:
            left = None if time_limit is None else max(0.0, time_limit - (time.perf_counter() - t0))
            _, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return records


# ------------------------------------------------------------------------------------------------ metrics
def parse_slo(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms), as ``benchmark_serving --goodput``."""
    slo: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--slo {item!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: expected NAME:MILLISECONDS, such as ttft:500") from None
        if not slo[name] > 0:
            raise ValueError(f"--slo {item!r}: the target must be > 0 ms")
    return slo


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> ``(50.0, 90.0, 99.0)``; each in [0, 100]."""
    try:
        ps = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--percentiles {text!r}: expected numbers separated by commas, such as 50,90,99") from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"--percentiles {text!r}: every percentile must be in [0, 100]")
    return ps


def _pct_key(p: float) -> str:
    """``benchmark_serving``'s name of a percentile: ``p99``, ``p99.9``."""
    return f"p{int(p) if int(p) == p else p}"


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, standard deviation (population, ``np.std``) and ``percentiles`` (``np.percentile``'s linear
    interpolation) of ``values_s`` (seconds), in milliseconds; every entry None when there is no value."""
    v = 1000 * np.asarray(values_s, dtype=float)
    keys = ["mean", "median", "std", *map(_pct_key, percentiles)]
    if not len(v):
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": float(v.mean()), "median": float(np.median(v)), "std": float(v.std())}
    out.update({_pct_key(p): float(np.percentile(v, p)) for p in percentiles})
    return out


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a completed request meets every target (ms); a one-token output has TPOT 0, as vLLM counts it."""
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.latency}
    return all((v := values[k]) is not None and 1000 * v <= target for k, target in slo.items())


def summarize(records: Sequence[RequestRecord], percentiles: Sequence[float] = (99,),
              slo: dict[str, float] | None = None) -> dict:
    """``benchmark_serving``'s result, in the layout of its JSON (``vllm/benchmarks/serve.py``, ``--save-result``):
    flat keys. Over the completed requests: ``duration`` (s, from the first request sent to the last token of a
    completed one), ``completed``, ``total_input_tokens``, ``total_output_tokens``, ``request_throughput``,
    ``output_throughput``, ``total_token_throughput``, ``request_goodput`` (req/s of completed requests meeting
    every ``slo`` target; None without targets), and per metric of ``METRICS`` ``mean_X_ms``, ``median_X_ms``,
    ``std_X_ms`` and ``pP_X_ms`` (TTFT; TPOT of requests of two tokens or more; ITL, every gap between
    token-carrying chunks; E2EL; and the paper's normalised latency ``nl``, ms per output token, §6.1). Per request,
    in trace order: ``input_lens``, ``output_lens`` (0 unless completed), ``ttfts``, ``itls``, ``latencies`` (s;
    None unless they happened), ``start_times`` (s from the start), ``errors`` (``""`` for none). Beside vLLM's
    ``failed``: ``cancelled`` (due before the time limit, unfinished at it) and ``not_sent`` (due after it)."""
    ok = [r for r in records if r.status == "ok"]
    sent = [r.sent for r in records if r.sent is not None]
    end = max((r.last_token for r in ok if r.last_token is not None), default=None)
    duration = end - min(sent) if end is not None and sent else None
    rate = (lambda x: x / duration) if duration and duration > 0 else (lambda x: None)
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.tokens for r in ok)
    values = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.latency for r in ok if r.latency is not None],
              "nl": [r.normalized_latency for r in ok if r.normalized_latency is not None]}
    count = lambda status: sum(r.status == status for r in records)  # noqa: E731
    out = {"duration": duration, "completed": len(ok), "failed": count("error"), "cancelled": count("cancelled"),
           "not_sent": count("not_sent"), "requests": len(records),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": rate(len(ok)), "request_goodput": rate(sum(meets_slo(r, slo) for r in ok)) if slo
           else None, "output_throughput": rate(total_out), "total_token_throughput": rate(total_in + total_out),
           "slo_ms": dict(slo or {}), "percentiles": list(percentiles)}
    for name in METRICS:
        out.update({f"{k}_{name}_ms": v for k, v in distribution(values[name], percentiles).items()})
    out.update({"input_lens": [r.prompt_len for r in records],
                "output_lens": [r.tokens if r.status == "ok" else 0 for r in records],
                "ttfts": [r.ttft for r in records], "itls": [list(r.itl) for r in records],
                "latencies": [r.latency for r in records], "start_times": [r.sent for r in records],
                "errors": [r.error or "" for r in records]})
    return out


def format_summary(s: dict) -> str:
    """A text table of ``summarize``'s result, in the layout of ``benchmark_serving``'s."""
    def num(x, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    titles = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)", "itl": "Inter-token latency",
              "e2el": "End-to-end latency", "nl": "Normalised latency (§6.1, ms per output token)"}
    lines = [f"{'Successful requests:':<40}{s['completed']} (failed {s['failed']}, cancelled {s['cancelled']}, "
             f"not sent {s['not_sent']}, of {s['requests']})",
             f"{'Benchmark duration (s):':<40}{num(s['duration'])}",
             f"{'Total input tokens:':<40}{s['total_input_tokens']}",
             f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
             f"{'Request throughput (req/s):':<40}{num(s['request_throughput'])}",
             f"{'Output token throughput (tok/s):':<40}{num(s['output_throughput'])}",
             f"{'Total token throughput (tok/s):':<40}{num(s['total_token_throughput'])}"]
    if s["slo_ms"]:
        targets = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items())
        lines.append(f"{'Request goodput (req/s):':<40}{num(s['request_goodput'])} (SLO: {targets})")
    for name in METRICS:
        lines.append(f"--- {titles[name]} ---")
        for k in ["mean", "median", "std", *map(_pct_key, s["percentiles"])]:
            lines.append(f"{k.capitalize()} (ms):".ljust(40) + num(s[f"{k}_{name}_ms"]))
    return "\n".join(lines)


async def fit_context(url: str, requests: Sequence[TraceLike], endpoint: str, max_model_len: int) -> list:
    """The requests whose prompt, counted by the server's ``/tokenize`` (after its chat template for ``chat``), and
    output fit in ``max_model_len``, as ``benchmark_serving`` keeps only requests that fit its model: a text prompt's
    length on the client's tokenizer is not the server's. Token-id prompts are counted as they are."""
    import httpx

    async def fits(client, r) -> bool:
        prompt = getattr(r, "prompt", None)
        if not isinstance(prompt, str):
            return r.prompt_len + r.output_len <= max_model_len
        body = {"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat" else {"prompt": prompt}
        resp = await client.post("/tokenize", json=body)
        return resp.status_code == 200 and resp.json()["count"] + r.output_len <= max_model_len

    async with httpx.AsyncClient(base_url=base_url(url), timeout=60) as client:
        keep = [await fits(client, r) for r in requests]
    return [r for r, k in zip(requests, keep) if k]


# ------------------------------------------------------------------------------------------------ command line
def write_mooncake(trace: Sequence[TraceLike], path: str) -> None:
    """The trace as a Mooncake-style JSONL (``timestamp`` in ms, ``input_length``, ``output_length``; ``text`` for a
    text prompt), the format that AIPerf's trace replay reads: another client can then send the same requests at the
    same times, and ``read_mooncake`` reads it back."""
    with open(path, "w") as f:
        for r in trace:
            row: dict[str, float | str] = {"timestamp": round(1000 * r.arrival_time, 3), "input_length": r.prompt_len,
                   "output_length": r.output_len}
            prompt = getattr(r, "prompt", None)
            if isinstance(prompt, str):
                row["text"] = prompt
            f.write(json.dumps(row) + "\n")


def read_mooncake(path: str) -> list[Request]:
    """The requests of a Mooncake-style JSONL (``write_mooncake``'s, or AIPerf's: other keys are ignored): arrival
    ``timestamp`` (ms), ``input_length`` (random token ids of that length unless the row has a ``text`` prompt) and
    ``output_length``. A row without them is a ``ValueError`` naming its line."""
    out: list[Request] = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(Request(f"{Path(path).stem}-{len(out)}", float(row["timestamp"]) / 1000,
                                   int(row["input_length"]), int(row["output_length"]), row.get("text")))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {i}: expected a JSON object with timestamp (ms), input_length and "
                                 f"output_length ({type(e).__name__}: {e})") from None
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every replay command line (this module's and ``pagedattn.repro.experiments.replay``'s)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions: /v1/completions; chat: /v1/chat/completions (needs text prompts)")
    p.add_argument("--burstiness", type=float, default=None,
                   help="gamma arrivals of this shape at --rate (1: Poisson; lower: burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first model)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below this (default: the server's, else 512)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for an endpoint that refuses unknown fields)")
    p.add_argument("--percentiles", default="99", help="the percentiles to report, such as 50,90,95,99")
    p.add_argument("--slo", nargs="*", default=None, metavar="METRIC:MS",
                   help="goodput targets in ms, such as ttft:500 tpot:50 e2el:2000 (vLLM's --goodput)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the per-request CSV here")
    p.add_argument("--result-file", "--json", default=None,
                   help="write the JSON result (benchmark_serving's layout, and the settings) here")


def check_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """``add_arguments``' options parsed (``percentiles``, ``slo``) and checked; ``p.error`` names a bad one."""
    try:
        a.percentiles, a.slo = parse_percentiles(a.percentiles), parse_slo(a.slo)
    except ValueError as e:
        p.error(str(e))
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    if a.burstiness is not None and not a.burstiness > 0:
        p.error(f"--burstiness must be > 0, got {a.burstiness}")
    return a


def retime(requests: list[Request], rate: float, burstiness: float, seed: int) -> list[Request]:
    """The same requests at ``gamma_arrivals(len, rate, burstiness, seed)``."""
    t = gamma_arrivals(len(requests), rate, burstiness, seed)
    return [Request(r.request_id, float(at), r.prompt_len, r.output_len, getattr(r, "prompt", None))
            for r, at in zip(requests, t)]


def write_csv(path, rows: list[dict]) -> None:
    """The per-request CSV (``--out``), one row per ``RequestRecord.row()``; None is an empty field."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


def run(a: argparse.Namespace, requests: Sequence[TraceLike], described: str) -> dict:
    """Replay ``requests`` with ``add_arguments``' options ``a``; print the summary (``described`` says what was
    sent), write the CSV (``--out``) and the JSON result (``--result-file``: the summary and every option); return
    the summary."""
    card = asyncio.run(fetch_model_card(a.url))
    model = a.model or card["id"]
    vocab = a.vocab_size or card.get("vocab_size") or 512
    asked = len(requests)
    if card.get("max_model_len") and any(isinstance(getattr(r, "prompt", None), str) for r in requests):
        requests = asyncio.run(fit_context(a.url, requests, a.endpoint, card["max_model_len"]))
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    records = asyncio.run(replay(a.url, requests, model, vocab, a.ignore_eos, a.time_limit, a.seed,
                                 endpoint=a.endpoint, max_concurrency=a.max_concurrency))
    summary = {**summarize(records, a.percentiles, a.slo), "too_long": asked - len(requests)}
    print(f"{described}, burstiness {a.burstiness or '-'}, max concurrency {a.max_concurrency or '-'}, to "
          f"{base_url(a.url)}{ENDPOINTS[a.endpoint]} ({model}); {summary['too_long']} left out as longer than the "
          "model's context")
    print(format_summary(summary))
    if a.out:
        write_csv(a.out, [r.row() for r in records])
        print(f"per-request CSV: {a.out}")
    if a.result_file:
        settings = {k: v for k, v in vars(a).items() if k not in summary and k not in ("percentiles", "slo", "model")}
        settings = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in settings.items()}
        with open(a.result_file, "w") as f:  # JSON has no infinity: a rate of inf is written "inf"
            json.dump({"date": started, "url": base_url(a.url), "model": model, "model_id": model,
                       "num_prompts": len(requests), **settings, **summary}, f, indent=1)
        print(f"JSON result: {a.result_file}")
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedattn.replay", description=__doc__.split("\n\n")[0],
                                epilog="The project's traces and ShareGPT text: python -m pagedattn.repro.experiments.replay")
    p.add_argument("--requests", required=True, metavar="JSONL",
                   help="the requests, as Mooncake JSONL (timestamp in ms, input_length, output_length; text)")
    p.add_argument("--rate", type=float, default=None,
                   help="send at this rate (gamma arrivals, --burstiness) instead of the file's timestamps")
    add_arguments(p)
    a = check_arguments(p, p.parse_args(argv))
    if a.burstiness is not None and a.rate is None:
        p.error("--burstiness needs --rate")
    return a


def check_httpx(main: bool = False) -> None:
    """Stop, naming the ``serve`` extra (``extras.missing_extra``), where its HTTP client, httpx, is missing: the
    functions that send requests import it when called, so a command line checks once, up front, and ends with one
    line (``main``) instead of a traceback from its first request."""
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        missing_extra("serve", "pagedattn.replay", e, main=main)


def main(argv=None) -> dict:
    a = parse_args(argv)
    check_httpx(main=True)
    requests = read_mooncake(a.requests)
    if a.rate is not None:
        requests = retime(requests, a.rate, a.burstiness or 1.0, a.seed)
    return run(a, requests, f"{len(requests)} requests of {a.requests}")


if __name__ == "__main__":
    main()
