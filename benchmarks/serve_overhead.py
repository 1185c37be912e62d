"""Where a live server's latency exceeds the simulator's prediction (notebook 13, ``experiments.online_serving``):
the paged server against the same engine in-process on the same requests (not part of CI; about a minute).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/serve_overhead.py

It prints, for the offline trace (80 requests at t = 0): the span through the server and in-process, the server's
and the client's CPU seconds (the server from /proc, the client, this process, from getrusage), and the extra time
per streamed token and per step; and for an 80-request trace of other requests (the next seed) at 5 req/s (about one
request per step) and at 30 req/s: normalized latency served, in-process and predicted with the engine's fitted step
time alone, the median time to first token of each, and each request's extra latency fitted as ``a + b x output
tokens`` (served - simulated, in-process - simulated, served - in-process). The step time is fitted as notebook 13
fits it (offline run and a 40-request calibration trace at 5 req/s), with no server cost: the simulation is the
engine's alone. The numbers go to ``results/benchmarks/serve_overhead.json``, which notebook 13 reads for its account
of the prediction's error.
"""
from __future__ import annotations

import json
import math
import os
import resource
import tempfile
from dataclasses import replace

import torch

from pagedattn.repro.sim.capacity import normalized_latency
from pagedattn.repro.experiments import online_serving as O
from pagedattn.repro.experiments.common import tiny_opt


def server_cpu(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(url: str, pid: int, trace, vocab: int):
    s0, c0 = server_cpu(pid), client_cpu()
    df = O.send(url, trace, vocab)
    return df, server_cpu(pid) - s0, client_cpu() - c0


def main() -> None:
    from pagedattn.repro.report.results import RESULTS_DIR, hardware_label, today

    p = O.Params.make(False, vllm=False)
    vocab = p.model["vocab_size"]
    torch.set_num_threads(1)
    model = tiny_opt(p.seed, **p.model)
    off = p.trace(math.inf)
    fit, info, _ = O.measure_step_time(model, p, "paged", replace(p, seed=p.seed + 1).trace(5.0, 40))
    steps = info["offline_steps"]
    record = {"date": today(), "machine": hardware_label("cpu"), "offline_requests": len(off),
              "offline_tokens": info["tokens"], "offline": [], "rates": {}}
    with tempfile.TemporaryDirectory() as ckpt:
        model.save_pretrained(ckpt)
        with O.Server.ours(ckpt, "paged", p) as srv:
            pid = srv.proc.pid
            O.send(srv.url, off, vocab)  # warm-up
            for rep in range(2):
                df, s, c = timed(srv.url, pid, off, vocab)
                span, extra_s = float(df.finish_time.max()), float(df.finish_time.max()) - info["in_process_s"]
                record["offline"].append({"served_s": span, "in_process_s": info["in_process_s"], "server_cpu_s": s,
                                          "client_cpu_s": c, "client_cpu_us_per_token": 1e6 * c / info["tokens"],
                                          "extra_us_per_token": 1e6 * extra_s / info["tokens"],
                                          "extra_us_per_step": 1e6 * extra_s / steps})
                print(f"offline {rep}: span {span:.3f} s served, {info['in_process_s']:.3f} s in-process; server CPU "
                      f"{s:.2f} s, client CPU {c:.2f} s; extra {1e6 * extra_s / info['tokens']:.0f} us per token or "
                      f"{1e6 * extra_s / steps:.0f} us per step")
            for rate in (5.0, 30.0):
                tr = replace(p, seed=p.seed + 1).trace(rate)
                df, s, c = timed(srv.url, pid, tr, vocab)
                _, local = O.in_process(model, "paged", p, tr)
                sim = O.predict(tr, "paged", p, fit)
                tokens = int(df.output_len.sum())
                row = {"nl_served_ms": 1e3 * normalized_latency(df), "nl_in_process_ms": 1e3 * normalized_latency(local),
                       "nl_engine_fit_ms": 1e3 * normalized_latency(sim), "server_cpu_us_per_token": 1e6 * s / tokens,
                       "client_cpu_us_per_token": 1e6 * c / tokens, "ttft_served_ms": 1e3 * df.ttft_s.median(),
                       "ttft_in_process_ms": 1e3 * (local.first_token_time - local.arrival_time).median(),
                       "ttft_engine_fit_ms": 1e3 * (sim.first_token_time - sim.arrival_time).median()}
                print(f"{rate:g} req/s: normalized latency {row['nl_served_ms']:.3f} ms served, "
                      f"{row['nl_in_process_ms']:.3f} in-process, {row['nl_engine_fit_ms']:.3f} simulated; server CPU "
                      f"{row['server_cpu_us_per_token']:.0f} us, client CPU {row['client_cpu_us_per_token']:.0f} us "
                      f"per token; median TTFT {row['ttft_served_ms']:.2f} ms served, "
                      f"{row['ttft_in_process_ms']:.2f} in-process, {row['ttft_engine_fit_ms']:.2f} simulated")
                for name, (a, b) in {"served_minus_engine_fit": (df, sim), "in_process_minus_engine_fit": (local, sim),
                                     "served_minus_in_process": (df, local)}.items():
                    i, k = O.latency_gap(a, b)
                    row[name] = {"per_request_ms": 1e3 * i, "per_token_us": 1e6 * k}
                    print(f"    {name}: {1e3 * i:.2f} ms + {1e6 * k:.0f} us x output tokens")
                record["rates"][f"{rate:g}"] = row
    out = RESULTS_DIR / "benchmarks" / "serve_overhead.json"
    out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
