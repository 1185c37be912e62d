"""Experiment 13: the paper's online experiment on running servers, and the simulator checked against them (paper
§6.1-§6.2, Fig. 12).

The paper measures serving systems online: requests arrive by a Poisson process and each is timed from its arrival
to its last token (normalized latency, §6.1). Every paper-scale figure here comes from the simulator
(``pagedattn.repro.sim``: the real scheduler and KV managers with a step-time model); this experiment tests that method
against live servers on this machine:

1. **Servers.** ``python -m pagedattn.serve`` serves the same checkpoint (a small random-weight OPT saved with
   ``save_pretrained``) in its own process, once per system: paged, and the Orca (Oracle) and Orca (Max) contiguous
   reservations, on the same KV budget. The scaling rule is notebook 03's: every length and the budget divided by 4
   (ShareGPT lengths / 4; 15.7K / 4 = 3.9K token slots; max length 512), so that about as many requests fit as in
   the paper's setting and memory binds near capacity.
2. **Arrivals.** ``pagedattn.replay`` sends the real ShareGPT lengths (scaled) with Poisson arrivals at a sweep of
   rates, the same requests for every system, and times each request from sending to its last streamed token.
3. **The simulator's prediction** for the same trace, budget and rates, with a step time measured on this CPU for
   this model: ``measure_step_time`` runs the engine in-process on the same trace (every request at t = 0) and fits
   a decode step as ``a + b x sequences + c x context tokens`` and a prefill step as ``a' + d x prompt tokens`` by
   least squares over its steps (``FittedStepTime``). Prediction and measurement are compared at each rate.
4. **Sustainable rate** with ``pagedattn.repro.capacity``'s two rules (latency threshold and no growing queue over the
   steady window), read off the rate grid: its resolution is the grid's spacing, stated beside it.

A server's wall clock counts the HTTP and streaming work that an in-process step time does not (one event per
token), so the prediction's error at each rate is the measure of what the simulator leaves out at this scale; the
offline throughput through the server and in-process are reported side by side. With ``url`` set, the same sweep
runs against any OpenAI-compatible endpoint (a vLLM deployment on GPUs, for example) instead of our servers.
"""
from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from pagedattn.repro.capacity import Load, normalized_latency
from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import ServingParams, tiny_opt
from pagedattn.repro.experiments.throughput import TINY_OPT, RealParams
from pagedattn.repro.results import RESULTS_DIR, Claim
from pagedattn.repro.sim import LABELS, CostModel, simulate
from pagedattn.repro.workloads import TraceRequest, with_rate

EXPERIMENT = "13_online_serving"
SYSTEMS = ("orca_max", "orca_oracle", "paged")


@dataclass
@validated
class Params(ServingParams):
    """``load_fractions`` are rates as fractions of each server's own offline throughput (every request sent at
    t = 0, measured first), so that each system's grid brackets its own knee whatever the CPU's speed."""

    scale: int = 4
    num_requests: int = 80
    load_fractions: tuple = (0.4, 0.7, 0.85, 1.0, 1.15)
    systems: tuple = SYSTEMS
    model: dict = field(default_factory=lambda: dict(TINY_OPT))
    threads: int = 1
    #: normalized latency above which a rate is not sustainable: 5x the paged server's at the lowest rate, the rule
    #: of notebook 03's CPU scale
    threshold_factor: float = 5.0
    url: str | None = None  # an OpenAI-compatible endpoint to measure instead of starting our servers

    QUICK = dict(num_requests=30, load_fractions=(0.4, 1.0), systems=("orca_oracle", "paged"))

    @property
    def real(self) -> RealParams:
        """Notebook 03's CPU scale: the same length and budget scaling."""
        return RealParams(scale=self.scale, num_requests=self.num_requests, model=dict(self.model), seed=self.seed,
                          block_size=self.block_size, threads=self.threads)

    def trace(self, rate: float) -> list[TraceRequest]:
        return self.real.trace("sharegpt", self.num_requests, rate)


# ---------------------------------------------------------------------------------------- CPU step time
@dataclass
class FittedStepTime(CostModel):
    """A step time measured on this CPU for this model (``measure_step_time``): decode ``a + b x sequences + c x
    context tokens``, prefill ``a' + d x prompt tokens`` (seconds). The simulator calls ``decode_time`` and
    ``prefill_time``; nothing here is an A100's."""

    decode_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    prefill_s: float = 0.0
    prefill_per_token_s: float = 0.0

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        return self.decode_s + self.decode_per_seq_s * num_seqs + self.decode_per_context_token_s * context_tokens

    def prefill_time(self, num_tokens: int, num_seqs: int = 1) -> float:
        return self.prefill_s + self.prefill_per_token_s * num_tokens


def fit_step_time(steps: pd.DataFrame) -> tuple[FittedStepTime, dict]:
    """Least-squares fit of ``FittedStepTime`` to an engine's ``step_metrics_frame()``; also returns each fit's
    relative RMS error."""
    dec, pre = steps[steps.kind == "decode"], steps[steps.kind == "prefill"]
    x = np.column_stack([np.ones(len(dec)), dec.batch_size, dec.slots_filled])
    cd, *_ = np.linalg.lstsq(x, dec.step_time.to_numpy(), rcond=None)
    xp = np.column_stack([np.ones(len(pre)), pre.num_prefill_tokens])
    cp, *_ = np.linalg.lstsq(xp, pre.step_time.to_numpy(), rcond=None)

    def rel_rms(xm, c, y):
        return float(np.sqrt(np.mean((xm @ c - y) ** 2)) / np.mean(y))
    fit = FittedStepTime(decode_s=max(float(cd[0]), 0.0), decode_per_seq_s=float(cd[1]),
                         decode_per_context_token_s=float(cd[2]), prefill_s=max(float(cp[0]), 0.0),
                         prefill_per_token_s=float(cp[1]))
    return fit, {"decode_rel_rms": rel_rms(x, cd, dec.step_time.to_numpy()),
                 "prefill_rel_rms": rel_rms(xp, cp, pre.step_time.to_numpy()),
                 "decode_steps": len(dec), "prefill_steps": len(pre)}


def engine(model, system: str, params: Params):
    """The engine a server runs (``serve.load_engine``), keeping every step's metrics."""
    from pagedattn.serve import load_engine

    rp = params.real
    return load_engine(model, system, rp.num_slots, params.block_size, rp.max_model_len, max_step_metrics=None)


def measure_step_time(model, params: Params, system: str) -> tuple[FittedStepTime, dict]:
    """Run ``system``'s engine in-process on the experiment's requests, all queued at t = 0 (wall clock, one torch
    thread), and fit its step time; also returns the fit's errors, the run's seconds and the tokens generated. Each
    system gets its own fit: our contiguous managers run another attention path than the paged one."""
    from pagedattn.repro.experiments.common import Clock, replay as engine_replay

    trace = params.trace(math.inf)
    engine_replay(engine(model, system, params), _arrivals(trace[:4], params), Clock(time.perf_counter))  # warm up
    eng = engine(model, system, params)
    t = time.perf_counter()
    engine_replay(eng, _arrivals(trace, params), Clock(time.perf_counter, steps_only=True))
    seconds = time.perf_counter() - t
    fit, err = fit_step_time(eng.step_metrics_frame())
    return fit, {**err, "in_process_s": seconds, "tokens": sum(r.output_len for r in trace),
                 "offline_in_process_req_s": len(trace) / seconds}


def _arrivals(trace: list[TraceRequest], params: Params) -> list:
    from pagedattn.repro.experiments.common import Arrival, greedy
    from pagedattn.repro.workloads import synthetic_prompt

    return [Arrival(r.arrival_time, r.request_id, synthetic_prompt(r.prompt_len, params.model["vocab_size"], seed=i),
                    greedy(r.output_len), {}) for i, r in enumerate(trace)]


def server_cost_per_token(in_process_s: float, served_s: float, tokens: int) -> float:
    """The server's work per streamed token (HTTP, server-sent events): the difference between the same offline run
    through the server and in-process, spread over the tokens it generated (``(served - in-process) / tokens``
    seconds, not below zero)."""
    return max(served_s - in_process_s, 0.0) / tokens


def with_server_cost(engine_fit: FittedStepTime, per_token_s: float) -> FittedStepTime:
    """The engine's step time plus the server's cost per streamed token, charged to each sequence of a decode
    step."""
    return replace(engine_fit, decode_per_seq_s=engine_fit.decode_per_seq_s + per_token_s)


def predict(trace: list[TraceRequest], system: str, params: Params, cost: FittedStepTime) -> pd.DataFrame:
    """The simulator's per-request frame for ``trace`` under ``system`` with this CPU's step time, on the budget
    and limits of the servers (``RealParams.engine``: 256 sequences, 2048 batched tokens)."""
    rp = params.real
    return simulate(trace, system, rp.num_slots, params.block_size, cost, max_num_seqs=256,
                    max_num_batched_tokens=max(rp.max_model_len, 2048), max_model_len=rp.max_model_len,
                    record_steps=False).requests


# ------------------------------------------------------------------------------------------------ servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m pagedattn.serve CHECKPOINT --kv-manager SYSTEM`` in its own process (one torch thread), on a free
    loopback port; a context manager that waits for ``/health`` and stops the process on exit."""

    def __init__(self, checkpoint: str, system: str, params: Params) -> None:
        rp = params.real
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pagedattn.serve", checkpoint, "--served-model-name", "tiny",
                    "--kv-manager", system, "--num-slots", str(rp.num_slots), "--block-size", str(params.block_size),
                    "--max-model-len", str(rp.max_model_len), "--threads", str(params.threads),
                    "--port", str(self.port), "--log-level", "warning"]

    def __enter__(self) -> "Server":
        import httpx

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[3]),
                                                                           os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"the server did not answer /health within 120 s: {' '.join(self.cmd)}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def send(url: str, trace: list[TraceRequest], vocab_size: int, model: str = "tiny") -> pd.DataFrame:
    """Replay ``trace`` against ``url`` (``pagedattn.replay``, streaming, greedy, ``ignore_eos``) in a thread of its
    own (a notebook's kernel already runs an event loop); one row per completed request, with ``arrival_time`` the
    time it was sent and ``finish_time`` its last token (seconds from the start), as the capacity rule reads them."""
    from pagedattn.replay import replay

    with ThreadPoolExecutor(1) as pool:
        records = pool.submit(asyncio.run, replay(url, trace, model, vocab_size)).result()
    df = pd.DataFrame([r.row() for r in records])
    bad = df[df.status != "ok"]
    if len(bad):
        raise RuntimeError(f"{len(bad)} of {len(df)} requests did not complete: {bad.error.dropna().head(3).tolist()}")
    return pd.DataFrame({"request_id": df.request_id, "arrival_time": df.sent, "finish_time": df.last_token,
                         "output_len": df.tokens, "ttft_s": df.ttft, "tpot_s": df.tpot})


def _row(system: str, rate: float, fraction: float, measured: pd.DataFrame, predicted: pd.DataFrame) -> dict:
    m, p = Load.of(measured), Load.of(predicted)
    return {"system": system, "label": LABELS.get(system, system), "load_fraction": fraction, "rate": rate,
            "nl_measured_s": m.normalized_latency_s, "nl_predicted_s": p.normalized_latency_s,
            "nl_error_pct": 100 * (p.normalized_latency_s / m.normalized_latency_s - 1),
            "throughput_measured": m.completion_rate, "throughput_predicted": p.completion_rate,
            "keeps_up_measured": m.keeps_up(), "keeps_up_predicted": p.keeps_up(),
            "ttft_p50_s": float(measured.ttft_s.median()), "tpot_p50_s": float(measured.tpot_s.median())}


def sweep(params: Params, model, checkpoint: str, progress: bool = True
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Each system, the paged one first: its step time fitted in-process (``measure_step_time``), then its server:
    a warm-up, its offline throughput (every request sent at t = 0), and every rate of its grid (``load_fractions``
    of that throughput), with the simulator's prediction beside each measurement. The prediction's step time is the
    system's in-process fit plus the server's cost per streamed token, measured once on the paged server
    (``server_cost_per_token``). Returns the curves, the offline table and the step-time fits."""
    vocab = params.model["vocab_size"]
    systems = sorted(params.systems, key=lambda s: s != "paged")
    rows, offline, fits, per_token = [], [], [], None
    bar = tqdm(total=len(systems) * (1 + len(params.load_fractions)), desc="online servers", disable=not progress,
               leave=False)
    for system in systems:
        engine_fit, calib = measure_step_time(model, params, system)
        with (_Endpoint(params.url) if params.url else Server(checkpoint, system, params)) as server:
            trace = params.trace(math.inf)
            send(server.url, trace[:4], vocab)  # warm-up: the first requests pay one-time costs
            served = send(server.url, trace, vocab)
            bar.update()
            span = float(served.finish_time.max() - served.arrival_time.min())
            if per_token is None:  # the paged server: the server's cost per streamed token
                per_token = server_cost_per_token(calib["in_process_s"], span, calib["tokens"])
            cost = with_server_cost(engine_fit, per_token)
            fits.append({"system": system, "label": LABELS.get(system, system), **calib,
                         **{k: v for k, v in asdict(cost).items() if k.startswith(("decode", "prefill"))},
                         "server_per_token_s": per_token})
            offline.append({"system": system, "label": LABELS.get(system, system), "offline_served_s": span,
                            "offline_served_req_s": len(served) / span,
                            "offline_in_process_req_s": calib["offline_in_process_req_s"],
                            "offline_predicted_req_s": len(trace) / float(
                                predict(trace, system, params, cost).finish_time.max())})
            for f in params.load_fractions:
                rate = f * len(served) / span
                trace = params.trace(rate)
                rows.append(_row(system, rate, f, send(server.url, trace, vocab), predict(trace, system, params, cost)))
                bar.update()
    bar.close()
    return pd.DataFrame(rows), pd.DataFrame(offline), pd.DataFrame(fits)


class _Endpoint:
    """An external endpoint (``Params.url``): nothing to start or stop."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def sustainable(curves: pd.DataFrame, threshold_s: float, which: str) -> pd.DataFrame:
    """Each system's highest swept rate passing both rules of ``pagedattn.repro.capacity`` (latency at or below
    ``threshold_s``, no growing queue), for ``which`` = ``"measured"`` or ``"predicted"``; the resolution is the
    grid's step above that rate."""
    rows = []
    for s, d in curves.groupby("system", sort=False):
        d = d.sort_values("rate")
        ok = d[(d[f"nl_{which}_s"] <= threshold_s) & d[f"keeps_up_{which}"]]
        rate = float(ok.rate.max()) if len(ok) else float("nan")
        above = d[d.rate > rate].rate
        rows.append({"system": s, "label": LABELS.get(s, s), "which": which, "sustainable_rate": rate,
                     "resolution": float(above.min() / rate - 1) if len(above) and rate > 0 else float("inf"),
                     "threshold_s": threshold_s})
    return pd.DataFrame(rows)


def claims(curves: pd.DataFrame, sus: pd.DataFrame) -> list[Claim]:
    """CPU timings of a tiny model on this machine: recorded (``tracking``), not judged against the paper."""
    out = []
    err = curves.nl_error_pct.abs()
    out.append(Claim("online.prediction_error_pct.median", None, round(float(err.median()), 1), "%", "", None,
                     f"simulator with this CPU's fitted step time vs live servers, |error| of normalized latency over "
                     f"{len(curves)} (system, rate) points; max {err.max():.1f} %", kind="tracking"))
    for which in ("measured", "predicted"):
        r = sus[sus.which == which].set_index("system")
        for other in ("orca_oracle", "orca_max"):
            if other in r.index and "paged" in r.index and r.loc[other, "sustainable_rate"] > 0:
                ratio = float(r.loc["paged", "sustainable_rate"] / r.loc[other, "sustainable_rate"])
                res = max(float(r.loc["paged", "resolution"]), float(r.loc[other, "resolution"]))
                out.append(Claim(f"online.rate_ratio.paged_vs_{other}.{which}", "1.7-2.7" if other == "orca_oracle"
                                 else "2.7-8", round(ratio, 2), "x", "", None,
                                 f"{'live servers' if which == 'measured' else 'simulator prediction'} on this CPU, "
                                 f"tiny OPT, ShareGPT lengths and budget / 4; rates read off a grid (each rate known "
                                 f"to within {100 * res:.0f} % above it); the paper's range is for OPT-13B on an "
                                 f"A100", kind="tracking"))
    return out


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Calibrate, sweep, compare; writes CSVs, a figure and ``summary.json`` to ``<results_dir>/13_online_serving/``."""
    import torch

    from pagedattn.repro.results import hardware_label, write_summary

    params = Params.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(params.threads)
    try:
        model = tiny_opt(params.seed, **params.model)
        with tempfile.TemporaryDirectory() as ckpt:
            model.save_pretrained(ckpt)
            curves, offline, fits = sweep(params, model, ckpt, progress)
    finally:
        torch.set_num_threads(threads)
    low = curves[curves.system == "paged"].sort_values("rate").nl_measured_s.iloc[0]
    threshold = params.threshold_factor * float(low)
    sus = pd.concat([sustainable(curves, threshold, w) for w in ("measured", "predicted")], ignore_index=True)
    for name, df in (("curves", curves), ("sustainable", sus), ("offline", offline), ("step_time_fit", fits)):
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("cpu")
    m = params.model
    label = (f"live servers (pagedattn.serve, one torch thread each) and the simulator with this CPU's fitted step "
             f"time; OPT (random weights, fp32; hidden {m['hidden_size']}, {m['num_hidden_layers']} layers), "
             f"ShareGPT lengths and budget / {params.scale} ({params.real.num_slots} slots)")
    cl = claims(curves, sus)
    write_summary(out_dir, EXPERIMENT, hw, label, quick, cl,
                  extra={"params": asdict(params), "threshold_s": threshold})
    return {"curves": curves, "sustainable": sus, "offline": offline, "step_time_fit": fits,
            "threshold_s": threshold, "claims": cl, "out_dir": out_dir, "label": f"{hw} | {label} | quick={quick}"}
