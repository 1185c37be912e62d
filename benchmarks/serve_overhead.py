"""Where a live server's latency exceeds the simulator's prediction (notebook 13, ``experiments.online_serving``):
the paged server against the same engine in-process on the same requests (not part of CI; about a minute).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/serve_overhead.py

It prints, for the offline trace (80 requests at t = 0): the span through the server and in-process, the server's
and the client's CPU seconds (the server from /proc, the client, this process, from getrusage), and the extra time
per streamed token and per step; and for an 80-request trace of other requests (the next seed) at 5 req/s (about one
request per step) and at 30 req/s: normalized latency served, in-process and predicted with the engine's fitted step
time alone, the median time to first token of each, and each request's extra latency fitted as ``a + b x output
tokens`` (served - simulated, in-process - simulated, served - in-process). The step time is fitted as notebook 13
fits it (offline run and a 40-request calibration trace at 5 req/s). Two runs on the 2-core VM (Dec 2026; the first
with the offline run's fit only): offline 1.25-1.50 s served against 0.23-0.41 s in-process, server CPU 1.14-1.45 s,
client CPU 0.78-0.88 s; at 5 req/s server CPU 1.0 ms per token, served - in-process = 7.8-10.9 ms + 608-726 us x
output tokens, median TTFT 8.5-8.8 ms served against 0.8-1.15 ms in-process. The in-process times themselves moved
by up to 40 % between the runs (0.23 against 0.41 s offline).
"""
from __future__ import annotations

import math
import os
import resource
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from pagedattn.repro.capacity import normalized_latency
from pagedattn.repro.experiments import online_serving as O
from pagedattn.repro.experiments.common import tiny_opt


def server_cpu(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(url: str, pid: int, trace, vocab: int):
    s0, c0, t0 = server_cpu(pid), client_cpu(), time.perf_counter()
    df = O.send(url, trace, vocab)
    return df, server_cpu(pid) - s0, client_cpu() - c0, time.perf_counter() - t0


def extra(a, b) -> tuple[float, float]:
    """Each request's latency in ``a`` minus in ``b``, fitted as ``intercept + slope x output tokens``."""
    m, q = a.set_index("request_id"), b.set_index("request_id").loc[a.request_id]
    d = (m.finish_time - m.arrival_time) - (q.finish_time - q.arrival_time).to_numpy()
    slope, intercept = np.polyfit(m.output_len.to_numpy(dtype=float), d.to_numpy(dtype=float), 1)
    return intercept, slope


def main() -> None:
    p = O.Params.make(False, vllm=False)
    vocab = p.model["vocab_size"]
    torch.set_num_threads(1)
    model = tiny_opt(p.seed, **p.model)
    off = p.trace(math.inf)
    fit, info, _ = O.measure_step_time(model, p, "paged", replace(p, seed=p.seed + 1).trace(5.0, 40))
    steps = info["offline_steps"]
    with tempfile.TemporaryDirectory() as ckpt:
        model.save_pretrained(ckpt)
        with O.Server.ours(ckpt, "paged", p) as srv:
            pid = srv.proc.pid
            O.send(srv.url, off, vocab)  # warm-up
            for rep in range(2):
                df, s, c, _ = timed(srv.url, pid, off, vocab)
                span, extra_s = float(df.finish_time.max()), float(df.finish_time.max()) - info["in_process_s"]
                print(f"offline {rep}: span {span:.3f} s served, {info['in_process_s']:.3f} s in-process; server CPU "
                      f"{s:.2f} s, client CPU {c:.2f} s; extra {1e6 * extra_s / info['tokens']:.0f} us per token or "
                      f"{1e6 * extra_s / steps:.0f} us per step")
            for rate in (5.0, 30.0):
                tr = replace(p, seed=p.seed + 1).trace(rate)
                df, s, c, w = timed(srv.url, pid, tr, vocab)
                _, local = O.in_process(model, "paged", p, tr)
                sim = O.predict(tr, "paged", p, fit)
                tokens = int(df.output_len.sum())
                print(f"{rate:g} req/s: normalized latency {1e3 * normalized_latency(df):.3f} ms served, "
                      f"{1e3 * normalized_latency(local):.3f} in-process, {1e3 * normalized_latency(sim):.3f} "
                      f"simulated; server CPU {1e6 * s / tokens:.0f} us, client CPU {1e6 * c / tokens:.0f} us per "
                      f"token; median TTFT {1e3 * df.ttft_s.median():.2f} ms served, "
                      f"{1e3 * (local.first_token_time - local.arrival_time).median():.2f} in-process, "
                      f"{1e3 * (sim.first_token_time - sim.arrival_time).median():.2f} simulated")
                for name, (a, b) in {"served - simulated": (df, sim), "in-process - simulated": (local, sim),
                                     "served - in-process": (df, local)}.items():
                    i, k = extra(a, b)
                    print(f"    {name}: {1e3 * i:.2f} ms + {1e6 * k:.0f} us x output tokens")


if __name__ == "__main__":
    main()
