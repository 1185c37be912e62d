"""Replay the project's traces against any OpenAI-compatible endpoint and measure the paper's serving metrics.

``python -m pagedattn.replay --url http://127.0.0.1:8000 --trace sharegpt --rate 2 --num-requests 200`` sends the
requests of ``workloads.make_trace`` (the same lengths and Poisson arrivals that the simulator replays, §6.1) to
``/v1/completions``: each prompt is token ids of the trace's prompt length, ``max_tokens`` is the trace's output
length, with ``ignore_eos`` (an extra field that vLLM's server and ours accept; ``--no-ignore-eos`` leaves it out) and
greedy decoding. Every request streams, to time its first token. Per request it records the arrival (the trace's),
when it was sent, its first and last token, the tokens received, the latency, the normalised latency (latency /
output tokens, the paper's metric, §6.1), the time to first token (TTFT) and the time per output token after the
first (TPOT); it writes them to a CSV and prints a summary. It stops after ``--num-requests`` or at ``--time-limit``
seconds, cancelling what is still in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from pagedattn.repro.workloads import TRACES, TraceRequest, make_trace, synthetic_prompt


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
    status: str = "cancelled"  # "ok" | "error" | "cancelled" (still in flight at the time limit)
    error: str | None = None

    @property
    def latency(self) -> float | None:
        """End-to-end latency: from sending the request to its last token."""
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
        """Time per output token after the first."""
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)

    def row(self) -> dict:
        return {**asdict(self), "latency": self.latency, "normalized_latency": self.normalized_latency,
                "ttft": self.ttft, "tpot": self.tpot}


def base_url(url: str) -> str:
    """``http://host:port`` from a URL given with or without ``/v1``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _tokens_in(chunk: dict) -> int:
    """Tokens a streamed chunk carries: its choices' ``token_ids`` when the server sends them (ours always; vLLM's
    with ``return_token_ids``, which the replayer asks for: without a tokenizer its chunks have empty text), else one
    per choice with text (one token per chunk, as servers stream)."""
    return sum(len(c["token_ids"]) if c.get("token_ids") is not None else int(bool(c.get("text")))
               for c in chunk.get("choices") or [])


async def send_one(client, rec: RequestRecord, body: dict, t0: float) -> None:
    """Send one streaming completion and fill ``rec`` as its chunks arrive."""
    clock = time.perf_counter
    rec.sent = clock() - t0
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
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
                if n or any(c.get("finish_reason") for c in chunk.get("choices") or []):
                    now = clock() - t0
                    if rec.first_token is None:
                        rec.first_token = now
                    rec.last_token, rec.tokens = now, rec.tokens + n
        if usage and usage.get("completion_tokens") is not None:
            rec.tokens = int(usage["completion_tokens"])  # the server's own count wins
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


async def replay(url: str, trace: list[TraceRequest], model: str, vocab_size: int, ignore_eos: bool = True,
                 time_limit: float | None = None, seed: int = 0, extra: dict | None = None) -> list[RequestRecord]:
    """Send ``trace``'s requests at their arrival times (seconds from now) to ``url``; return one record each.
    Requests due after ``time_limit`` are not sent; those still in flight at ``time_limit`` are cancelled."""
    import httpx

    records = [RequestRecord(r.request_id, r.arrival_time, r.prompt_len, r.output_len) for r in trace]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url(url), timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for i, (r, rec) in enumerate(zip(trace, records)):
            if time_limit is not None and r.arrival_time >= time_limit:
                break
            await asyncio.sleep(max(0.0, r.arrival_time - (time.perf_counter() - t0)))
            body = {"model": model, "prompt": synthetic_prompt(r.prompt_len, vocab_size, seed * 1_000_003 + i),
                    "max_tokens": r.output_len, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True, **(extra or {})}
            if ignore_eos:
                body["ignore_eos"] = True
            tasks.append(asyncio.create_task(send_one(client, rec, body, t0)))
        if tasks:
            left = None if time_limit is None else max(0.0, time_limit - (time.perf_counter() - t0))
            _, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return records


def summarize(records: list[RequestRecord]) -> dict:
    """The paper's serving metrics over the completed requests (§6.1): mean normalised latency (s/token), request
    and token throughput, and the latency, TTFT and TPOT distributions."""
    df = pd.DataFrame([r.row() for r in records])
    ok = df[df["status"] == "ok"]
    start = df["sent"].min()
    end = ok["last_token"].max() if len(ok) else math.nan
    duration = float(end - start) if len(ok) else math.nan

    def stats(col: str) -> dict:
        v = ok[col].dropna().to_numpy(dtype=float)
        if not len(v):
            return {"mean": None, "p50": None, "p99": None}
        return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}

    return {"requests": len(df), "completed": len(ok), "errors": int((df["status"] == "error").sum()),
            "cancelled": int((df["status"] == "cancelled").sum()), "duration_s": duration,
            "request_throughput": len(ok) / duration if duration and duration > 0 else None,
            "output_token_throughput": float(ok["tokens"].sum()) / duration if duration and duration > 0 else None,
            "normalized_latency": stats("normalized_latency"), "latency": stats("latency"),
            "ttft": stats("ttft"), "tpot": stats("tpot")}


def format_summary(s: dict) -> str:
    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def ms(d: dict) -> str:
        return " / ".join(num(None if d[k] is None else 1000 * d[k], ".1f") for k in ("mean", "p50", "p99"))

    return "\n".join([
        f"requests: {s['completed']} completed, {s['errors']} errors, {s['cancelled']} cancelled, "
        f"of {s['requests']}; duration {s['duration_s']:.2f} s",
        f"throughput: {num(s['request_throughput'], '.3f')} req/s, "
        f"{num(s['output_token_throughput'], '.1f')} output tokens/s",
        f"normalized latency (§6.1, ms/token, mean / p50 / p99): {ms(s['normalized_latency'])}",
        f"latency (ms): {ms(s['latency'])}", f"TTFT (ms): {ms(s['ttft'])}", f"TPOT (ms): {ms(s['tpot'])}"])


def write_mooncake(trace: list[TraceRequest], path: str) -> None:
    """The trace as a Mooncake-style JSONL (``timestamp`` in ms, ``input_length``, ``output_length``), the format that
    AIPerf's trace replay reads: another client can then send the same requests at the same times."""
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps({"timestamp": round(1000 * r.arrival_time, 3), "input_length": r.prompt_len,
                                "output_length": r.output_len}) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedattn.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    p.add_argument("--trace", default="sharegpt", choices=TRACES)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s of the Poisson arrivals (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--scale", type=int, default=1,
                   help="divide every prompt and output length by this (a small model's max_model_len)")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first model)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below this (default: the server's, else 512)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for an endpoint that refuses unknown fields)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the CSV (default: replay_<trace>_rate<R>.csv)")
    p.add_argument("--write-trace", metavar="JSONL", default=None,
                   help="only write the trace as Mooncake JSONL (for AIPerf) and exit; no server is contacted")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    from pagedattn.repro.experiments.common import scaled_trace

    trace = make_trace(a.trace, a.num_requests, a.rate, a.seed) if a.scale == 1 else \
        scaled_trace(a.trace, a.num_requests, a.scale, a.rate, a.seed)
    if a.write_trace:
        write_mooncake(trace, a.write_trace)
        print(f"wrote {len(trace)} requests of {a.trace} at {a.rate:g} req/s to {a.write_trace}")
        return {"requests": len(trace)}
    card = asyncio.run(fetch_model_card(a.url)) if a.model is None or a.vocab_size is None else {}
    model = a.model or card["id"]
    vocab = a.vocab_size or card.get("vocab_size") or 512
    records = asyncio.run(replay(a.url, trace, model, vocab, a.ignore_eos, a.time_limit, a.seed))
    out = a.out or f"replay_{a.trace}_rate{a.rate:g}.csv"
    pd.DataFrame([r.row() for r in records]).to_csv(out, index=False)
    summary = summarize(records)
    print(f"{a.trace} at {a.rate:g} req/s against {base_url(a.url)} ({model}); per-request CSV: {out}")
    print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
