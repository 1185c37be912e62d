"""Soak test of the OpenAI-compatible server (issue 29): many short requests against one in-process server, checking
that resident memory stays flat and that no engine container grows (not part of CI; 20,000 requests take a while).

    PYTHONPATH=src python benchmarks/serve_soak.py --num-requests 20000      # the full soak
    PYTHONPATH=src python benchmarks/serve_soak.py --num-requests 500        # a quick look

A closed loop of ``--concurrency`` clients sends the tiny OPT short requests: streaming and not, n = 1 or 2, a
malformed one (400) and a client that disconnects after its first chunk every 50 requests. At every tenth of the run
it records resident memory (VmRSS) and the sizes of the engine's containers; at the end every container must be
empty (``step_metrics`` at most its ring size), every KV block free, and memory after the first tenth (the warm-up:
allocator pools, compiled kernels) may grow by at most ``--max-growth-mib``.
Measured on the 2-core VM: 2,000 requests in 27 s, RSS +3 MiB after the first tenth (about 1 KiB per request
of native memory; tracemalloc finds no Python object growing), every container empty at the end. Writes a JSON report with ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from pagedattn.async_engine import AsyncEngine
from pagedattn.serve import build_app, load_engine, serve_in_thread


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def containers(a: AsyncEngine) -> dict[str, int]:
    """Every per-request container of the server and the engine that could grow."""
    e, s = a.engine, a.engine.scheduler
    kv = e.kv
    used = kv.num_used_gpu_blocks
    sizes = {"streams": len(a._streams), "queued": len(a._queued), "aborts": len(a._aborts),
             "engine.requests": len(e.requests), "waiting": len(s.waiting), "running": len(s.running),
             "swapped": len(s.swapped), "kv.tables": len(getattr(kv, "tables", {})), "kv.used_blocks": used,
             "step_metrics": len(e.step_metrics)}
    sizes["generators"] = len(e.sampler.generators)
    sizes["pending_copies"] = len(s.pending_copies)
    if e.processor.detokenizer is not None:
        sizes["detokenizer.states"] = len(e.processor.detokenizer.states)
    for name in ("cached", "block_hash"):  # the prefix cache (bounded by the pool; empty without prefix caching)
        if hasattr(getattr(kv, "gpu", None), name):
            sizes[f"kv.gpu.{name}"] = len(getattr(kv.gpu, name))
    return sizes


async def client_loop(client: httpx.AsyncClient, i0: int, stride: int, total: int, counts: dict) -> None:
    for i in range(i0, total, stride):
        body = {"prompt": [3 + (i * 7 + k) % 500 for k in range(4 + i % 12)], "max_tokens": 2 + i % 7,
                "temperature": 0 if i % 3 else 0.8, "seed": i, "n": 1 + (i % 5 == 0), "ignore_eos": True}
        if i % 50 == 17:  # malformed
            body["top_p"] = 5
        if i % 50 == 33:  # disconnects after the first chunk
            body.update(stream=True, max_tokens=64)
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            counts["disconnected"] += 1
            continue
        if i % 2:
            body["stream"] = True
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
                status = r.status_code
        else:
            status = (await client.post("/v1/completions", json=body)).status_code
        counts[status] = counts.get(status, 0) + 1


async def drive(url: str, total: int, concurrency: int, a: AsyncEngine, samples: list) -> dict:
    """Send ``total`` requests from ``concurrency`` clients (one connection pool each, kept for the whole run: a new
    httpx client per batch costs the process about 0.7 MB of RSS that never comes back, which would hide the
    server's own memory); sample memory and containers at every tenth."""
    counts: dict = {"disconnected": 0}
    chunk = max(1, total // 10)
    done = 0
    clients = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(concurrency)]
    try:
        while done < total:
            n = min(chunk, total - done)
            await asyncio.gather(*(client_loop(c, done + k, concurrency, done + n, counts)
                                   for k, c in enumerate(clients)))
            done += n
            while a.num_in_flight or a.engine.has_unfinished_requests():
                await asyncio.sleep(0.02)
            samples.append({"requests": done, "rss_mib": rss_mib(), **containers(a)})
            print(json.dumps(samples[-1]), flush=True)
    finally:
        for c in clients:
            await c.aclose()
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-manager", default="paged")
    p.add_argument("--max-step-metrics", type=int, default=1000)
    p.add_argument("--max-growth-mib", type=float, default=32.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    engine = load_engine("tiny:opt", a.kv_manager, num_slots=4096, max_model_len=256,
                         max_step_metrics=a.max_step_metrics)
    async_engine = AsyncEngine(engine)
    samples: list = []
    t0 = time.perf_counter()
    with serve_in_thread(build_app(async_engine, "tiny:opt")) as url:
        counts = asyncio.run(drive(url, a.num_requests, a.concurrency, async_engine, samples))
    last = samples[-1]
    growth = last["rss_mib"] - samples[0]["rss_mib"]
    half = samples[len(samples) // 2]
    slope = 1024 * (last["rss_mib"] - half["rss_mib"]) / max(1, last["requests"] - half["requests"])
    leaks = {k: v for k, v in last.items() if k not in ("requests", "rss_mib", "step_metrics") and v}
    ok = not leaks and last["step_metrics"] <= a.max_step_metrics and growth <= a.max_growth_mib \
        and counts.get(500, 0) == 0
    report = {"num_requests": a.num_requests, "seconds": time.perf_counter() - t0, "statuses": counts,
              "engine_steps": engine.num_steps, "rss_growth_after_first_tenth_mib": growth,
              "rss_kib_per_request_second_half": slope, "leaks": leaks,
              "ok": ok, "samples": samples}
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, default=str))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
