"""The simulated executor: the real scheduler and KV managers, driven at the paper's scale with no model.

A trace replay runs the same ``Scheduler`` and ``BlockManager`` / ``ContiguousKVManager`` as the real engine; the
forward pass is replaced by a step-time model and each running sequence gains one (dummy) token per step. This is
how OPT-13B on an A100-40GB (15.7K token slots, paper Table 1) is reproduced on a laptop.

The step-time model is a roofline (``CostModel``): a decode step reads the weights and every running sequence's K/V
from HBM; a prefill step is bound by the larger of the weight read and the prompt FLOPs; each step pays a fixed
framework overhead; a step that swaps (§4.5) also pays its PCIe copies. Its constants are the A100-40GB datasheet's
(1.555 TB/s, 312 TFLOP/s fp16) derated by efficiencies measured on an A100 and a per-step overhead measured as a
function of the batch, all derived from Vidur's published A100 operator profiles (``pagedattn.repro.sim.cost_profile``, which
names the source files, commits and the MIT licence): decode bandwidth efficiency 0.65, large-prefill FLOP efficiency
0.64, overhead 0.79 ms + 0.043 ms per sequence. None of them is fitted to the paper's figures. How far an agreement
with the paper rests on them is what ``pagedattn.repro.experiments.sensitivity`` reports, as a band over their measured spread
(``sensitivity.MEASURED_BAND``). The constants chosen before any were measured (0.7, 0.5, a flat 4 ms per step) stay
as the named variant ``CostModel.assumed()``, and each band also reports the claim under them. The PCIe model is
still assumed (32 GB/s x 0.8, 5 us per copy).

Beam search (§4.4, Fig. 14b) has no model to score candidates here, so ``BeamModel`` draws which beams survive each
step, with a mean number of distinct parents measured on the real engine (notebook 04); see its docstring.

A replay takes the decode steps that are sure to change nothing but lengths, slots and the clock (no arrival
admitted, no preemption or copy, no finish before the last of them) as a run, without scheduling each
(``runs.RunCore``, the engine core with its step chosen once; the scheduler and the engine know nothing of runs): most
of a replay's steps, with the same results step for step (``tests/test_sim_golden.py``).

``simulate`` runs this module's replay compiled with mypyc when a build of it is present and up to date
(``pagedattn.repro.sim.fastsim``, ``make fastsim``): the same source and results, about twice as fast.
"""
from __future__ import annotations

import gc
import math
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Literal, cast
from typing import Sequence as Sequence_

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from pagedattn.repro.progress import interactive

from pagedattn.repro.sim.capacity import Load, normalized_latency, steady_window
from pagedattn.repro.sim.cost_profile import measured as _measured_a100
from pagedattn.repro.sim.fastsim import compiled_when_built
from pagedattn.repro.sim.runs import RunCore
from pagedattn.config import SchedulerConfig
from pagedattn.repro.paper import OPT_13B, PARAM_GB, paper_slots
from pagedattn.core import EngineCore, StepMetrics
from pagedattn.memory.accounting import KVStats
from pagedattn.memory.interface import num_copied
from pagedattn.memory.systems import ITERATION_LEVEL, LABELS, SYSTEMS, make_kv_manager  # noqa: F401
from pagedattn.scheduler import ModelOutput, Scheduler, SchedulerOutputs
from pagedattn.sequence import FinishReason, SamplingParams, Sequence, SequenceGroup
from pagedattn.repro.workloads.traces import TraceRequest

System = Literal["paged", "orca_max", "orca_pow2", "orca_oracle", "ft"]
Placement = Literal["buddy", "exact"]  # ``ContiguousKVManager``'s
PreemptionMode = Literal["recompute", "swap"]  # ``SchedulerConfig``'s
#: How a preempted group comes back (§4.5), by rule name: ``simulate``'s ``preemption_mode`` under each. ``"vllm"`` is
#: the paper's vLLM's rule (vLLM v0's ``Scheduler._preempt``) and our scheduler's default
#: (``SchedulerConfig.preemption_mode``): a single-sequence group is recomputed, a multi-sequence group swapped (given
#: CPU swap space). Every headline runs under it. ``"forced_swap"`` swaps every group, single-sequence ones too: a
#: sensitivity row, not the paper's setup.
PREEMPTION_RULES: dict[str, PreemptionMode] = {"vllm": SchedulerConfig().preemption_mode, "forced_swap": "swap"}
HEADLINE_RULE = "vllm"
# The systems replayed, their labels and managers: ``memory.systems``' registry (``SYSTEMS``, ``LABELS``; the
# experiments compare Orca's three and ours, ``ITERATION_LEVEL``, unless they say otherwise), imported from here.


_A100 = _measured_a100()


@dataclass
class CostModel:
    """Roofline step time of one iteration (seconds). Defaults: OPT-13B fp16 on one A100-40GB.

    Swapping (§4.5) is charged as vLLM v0 does it: one ``cudaMemcpyAsync`` per block, per layer, for K and for V, so
    ``n`` swapped blocks cost ``2 x num_layers x n`` copies of ``block_size x kv_bytes_per_token / (2 x num_layers)``
    bytes, each ``copy_latency_s`` plus its bytes over the PCIe bandwidth. Assumptions, not measurements: PCIe 4.0
    x16 (32 GB/s per direction, the A100 datasheet's 64 GB/s bidirectional) at 80 % efficiency, and 5 us per copy
    (the order of one small ``cudaMemcpyAsync`` between pinned host memory and the GPU).

    The per-step overhead is ``step_overhead_s + step_overhead_per_seq_s x batch`` (sequences decoded, or prompts
    prefilled). The defaults are ``measured_a100()``: derived from Vidur's A100 operator profiles
    (``pagedattn.repro.sim.cost_profile``, which names the source files, commits and licence): decode bandwidth efficiency
    0.65, prefill FLOP efficiency 0.64, overhead 0.79 ms + 0.043 ms per sequence. ``assumed()`` names the constants
    chosen before any was measured (0.7, 0.5, a flat 4 ms), kept so that the change in each verdict is visible."""

    weight_bytes: float = PARAM_GB[OPT_13B.name] * 1e9  # paper Table 1: 26 GB of OPT-13B weights
    params: float = 13e9
    kv_bytes_per_token: float = OPT_13B.kv_bytes_per_token
    num_layers: int = OPT_13B.num_layers
    hbm_bytes_per_s: float = 1.555e12  # A100-40GB datasheet
    # measured (cost_profile): decode bytes over Vidur's A100 operator times, a fraction of the datasheet
    bandwidth_efficiency: float = _A100["bandwidth_efficiency"]
    flops_per_s: float = 312e12  # A100 datasheet, fp16 tensor cores
    flops_efficiency: float = _A100["flops_efficiency"]  # measured: large prefills' FLOPs over their time
    # scheduler, sampling, input preparation: Vidur's per-step CPU overhead, fitted as intercept + slope x batch
    step_overhead_s: float = _A100["overhead_fit"].intercept_s
    step_overhead_per_seq_s: float = _A100["overhead_fit"].per_seq_s
    kernel_overhead: float = 1.0  # multiplier on the KV read time (block-size dependent, Fig. 18a/b)
    pcie_bytes_per_s: float = 32e9  # PCIe 4.0 x16, one direction
    pcie_efficiency: float = 0.8  # assumed
    copy_latency_s: float = 5e-6  # per cudaMemcpyAsync; assumed
    # Tensor parallelism (Megatron-LM style, §6.1: OPT-66B on 4 GPUs, OPT-175B on 8). ``tp_size`` GPUs each hold
    # 1/tp of the weights and of every token's K/V, so each reads 1/tp of the bytes and does 1/tp of the FLOPs
    # (``weight_bytes`` and ``kv_bytes_per_token`` stay the model's totals); each layer then pays one all-reduce of
    # the step's activations (``tokens x hidden_size x 2 B``) as a ring: ``2 (tp - 1) / tp`` of them over
    # ``allreduce_bytes_per_s`` plus ``allreduce_latency_s``. Assumptions: NVLink 3 at 300 GB/s per direction x 0.5
    # efficiency, 10 us per all-reduce (NCCL's small-message latency on one A100 node). tp_size 1: no term at all.
    tp_size: int = 1
    hidden_size: int = OPT_13B.num_kv_heads * OPT_13B.head_dim
    allreduce_bytes_per_s: float = 150e9  # assumed: 300 GB/s NVLink x 0.5
    allreduce_latency_s: float = 10e-6  # assumed, per all-reduce

    @classmethod
    def assumed(cls, **overrides) -> "CostModel":
        """The constants chosen before any was measured, named: bandwidth efficiency 0.7, FLOP efficiency 0.5, a
        flat 4 ms per step (the defaults until issue 30 switched them to ``measured_a100()``)."""
        return cls(**{"bandwidth_efficiency": 0.7, "flops_efficiency": 0.5, "step_overhead_s": 0.004,
                      "step_overhead_per_seq_s": 0.0, **overrides})

    @classmethod
    def measured_a100(cls, **overrides) -> "CostModel":
        """Constants measured on an A100 (``pagedattn.repro.sim.cost_profile.measured()``, from Vidur's Llama-2-7B profiles):
        the decode bandwidth efficiency and large-prefill FLOP efficiency (fractions of the datasheet, so they carry
        over to this model's A100-40GB peaks) and the fitted per-step overhead ``a + b x batch``: the defaults, so
        this is ``cls(**overrides)`` under a name that says so."""
        return cls(**overrides)

    def overhead(self, num_seqs: int) -> float:
        """The per-step framework overhead of a step over ``num_seqs`` sequences."""
        return self.step_overhead_s + self.step_overhead_per_seq_s * num_seqs

    def allreduce_time(self, num_tokens: int) -> float:
        """One all-reduce per layer of ``num_tokens`` activations across ``tp_size`` GPUs (0 on one GPU)."""
        if self.tp_size <= 1:
            return 0.0
        nbytes = 2 * (self.tp_size - 1) / self.tp_size * num_tokens * self.hidden_size * 2
        return self.num_layers * (self.allreduce_latency_s + nbytes / self.allreduce_bytes_per_s)

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        bw = self.hbm_bytes_per_s * self.bandwidth_efficiency * self.tp_size
        mem = (self.weight_bytes + self.kernel_overhead * context_tokens * self.kv_bytes_per_token) / bw
        compute = 2 * self.params * num_seqs / (self.flops_per_s * self.flops_efficiency * self.tp_size)
        return self.overhead(num_seqs) + max(mem, compute) + self.allreduce_time(num_seqs)

    def prefill_time(self, num_tokens: int, num_seqs: int = 1) -> float:
        """A prefill step of ``num_tokens`` prompt tokens from ``num_seqs`` prompts (the latter only moves the
        per-sequence overhead)."""
        bw = self.hbm_bytes_per_s * self.bandwidth_efficiency * self.tp_size
        compute = 2 * self.params * num_tokens / (self.flops_per_s * self.flops_efficiency * self.tp_size)
        return self.overhead(num_seqs) + max(self.weight_bytes / bw, compute) + self.allreduce_time(num_tokens)

    def copy_time(self, num_tokens: int) -> float:
        """Seconds to copy ``num_tokens`` tokens' K/V within the GPUs' HBM (read once, written once), as beam search
        does: a copy-on-write block (§4.4), or Orca's whole-context copy into a forked beam's reservation."""
        bw = self.hbm_bytes_per_s * self.bandwidth_efficiency * self.tp_size
        return 2 * num_tokens * self.kv_bytes_per_token / bw

    def swap_time(self, num_blocks: int, block_size: int = 16) -> float:
        """Seconds to move ``num_blocks`` blocks of ``block_size`` tokens one way over PCIe (§4.5, Fig. 19a)."""
        copies = 2 * self.num_layers * num_blocks
        nbytes = block_size * self.kv_bytes_per_token / (2 * self.num_layers)
        return copies * (self.copy_latency_s + nbytes / (self.pcie_bytes_per_s * self.pcie_efficiency))

    def step_time(self, out: SchedulerOutputs, block_size: int = 16) -> float:
        swap = self.swap_time(len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out), block_size)
        if out.prefill_groups:
            return self.prefill_time(out.num_batched_tokens, len(out.prefill_groups)) + swap
        lens = [len(s.token_ids) for g in out.decode_groups for s in g.get_seqs("running")]
        return self.decode_time(len(lens), sum(lens)) + swap

    def decode_step_time(self, num_seqs: int, context_tokens: int, swapped_blocks: int, block_size: int = 16) -> float:
        """``step_time`` of a decode step over ``num_seqs`` sequences and ``context_tokens`` tokens of context that
        swaps ``swapped_blocks`` blocks, given its counts (the simulator has them at hand)."""
        return self.decode_time(num_seqs, context_tokens) + self.swap_time(swapped_blocks, block_size)


#: Mean distinct parents among a beam group's ``k`` next beams per step, by beam width, measured on the real engine:
#: notebook 04's ``mean_distinct_parents`` (``results/04_sharing/savings.csv``, run of 2026-11-30: opt-stdlib's beam
#: search over Alpaca-like requests; 1.69 / 3.14 / 4.52 of 2 / 4 / 6; its ShareGPT-like rows: 1.65 / 3.08 / 4.58).
BEAM_DISTINCT_PARENTS = {2: 1.69, 4: 3.14, 6: 4.52}


def assumed_reason(kind: str) -> str:
    """The clause a claim's *reason* carries when its value rests on an assumed interconnect constant (issue 61):
    which constants, with their values as ``sim.CostModel`` holds them (``kind``: ``"swap"`` or ``"nvlink"``)."""
    c = CostModel()
    if kind == "swap":
        return (f"rests on assumed PCIe swap constants ({c.pcie_bytes_per_s / 1e9:g} GB/s x {c.pcie_efficiency:g} "
                f"per direction, {1e6 * c.copy_latency_s:g} us per copy)")
    if kind == "nvlink":
        return (f"rests on assumed NVLink constants ({c.allreduce_bytes_per_s / 1e9:g} GB/s effective, "
                f"{1e6 * c.allreduce_latency_s:g} us per all-reduce)")
    raise ValueError(f"kind must be 'swap' or 'nvlink', got {kind!r}")


@dataclass(frozen=True)
class BeamModel:
    """Beam search in the simulator (§4.4, Fig. 9), where no model scores the candidates.

    A beam group is ``width`` sequences that share the prompt's blocks and all run to the request's output length
    (``ignore_eos``, as Fig. 14's runs do). After every step each group draws how many distinct parents its
    ``width`` next beams have: 1 after the first token (HF's initial scores let only the first of ``width``
    identical beams expand), later ``floor(m)`` or ``floor(m) + 1`` with mean ``m = distinct_parents``. The parents
    are drawn uniformly among the beams; a parent keeps its own slot, and every other beam dies and its slot is
    forked from a parent drawn uniformly among them, as ``beam_search._reassign`` maps slots. So the K/V managers do
    what they do on the real engine: the paged one frees the dead beam's blocks and forks the parent's block table
    (reference counts, no copy; the next append copies a shared, partly filled last block on write), Orca's
    contiguous one copies the parent's whole K/V into the dead beam's reservation (HF's ``_reorder_cache``).

    Assumptions, stated and not fitted: the number of distinct parents is drawn afresh each step (no memory of past
    steps); parents are uniform among the beams (a real search tends to favour its best beams, which shares more
    history); no beam finishes early. The default ``m`` is ``BEAM_DISTINCT_PARENTS``; ``pagedattn.repro.experiments.sensitivity``
    moves it by one parent either way."""

    width: int
    distinct_parents: float

    def __post_init__(self) -> None:
        if not isinstance(self.width, int) or self.width < 2:
            raise ValueError(f"beam width must be an integer >= 2, got {self.width!r}")
        if not 1 <= self.distinct_parents <= self.width:
            raise ValueError(f"distinct_parents must be in [1, width={self.width}], got {self.distinct_parents!r}")

    @classmethod
    def measured(cls, width: int, shift: float = 0.0) -> "BeamModel":
        """The measured mean of ``BEAM_DISTINCT_PARENTS`` (moved by ``shift``, clipped to ``[1, width]``)."""
        if width not in BEAM_DISTINCT_PARENTS:
            raise ValueError(f"no measured beam model for width {width}; measured: {sorted(BEAM_DISTINCT_PARENTS)}")
        return cls(width, min(width, max(1.0, BEAM_DISTINCT_PARENTS[width] + shift)))

    def parents(self, rng: random.Random, first: bool) -> list[int]:
        """The indices of the beams that have children this step (``first``: the step of the first token). ``rng``
        is the standard library's (a draw per group and step: numpy's per-call overhead made this a quarter of a
        beam replay's time)."""
        m = 1.0 if first else self.distinct_parents
        d = int(m) + (rng.random() < m - int(m))
        return sorted(rng.sample(range(self.width), d))

    def forks(self, beams: list[Sequence], rng: random.Random, first: bool) -> list[tuple[Sequence, Sequence]]:
        """One step's survivors: every beam that is not a parent is re-forked from a parent drawn uniformly among
        them; returns those ``(parent, beam)`` forks for the scheduler (``Scheduler.update_from_output``). The paged
        manager then shares the parent's blocks (nothing copied); a contiguous one refills the beam's reservation
        with the parent's K/V, one slot copy per token, charged with the next step (``KVManager.fork_into``)."""
        parents = self.parents(rng, first)
        return [(beams[rng.choice(parents)], beam) for d, beam in enumerate(beams) if d not in parents]


@dataclass
class SimResult:
    system: str
    steps: pd.DataFrame  # one row per step
    requests: pd.DataFrame  # one row per request
    num_preemptions: dict = field(default_factory=dict)
    prefix_hit_rate: float | None = None  # share of looked-up prompt blocks found cached (paged, when looked up)
    prefill_tokens_computed: int = 0  # prompt tokens charged as computed (a cached prefix is not, but by ablation)
    steps_in_runs: int = 0  # steps taken within runs of steady decode steps (``runs.RunCore``)

    @property
    def duration(self) -> float:
        return float(self.requests["finish_time"].max())

    def steady_window(self) -> tuple[float, float]:
        """The run's steady state, ``[start, end)`` in seconds (``capacity.steady_window``: from the arrival of the
        request at a fifth of the trace to the last arrival; an offline run's is the whole run). Statistics over this
        window do not depend on how long the trace is, so that two notebooks replaying the same model at the same
        rate agree (§6.2, Fig. 13). It assumes that the ramp-up, about one request's lifetime, is shorter than a
        fifth of the arrival period (true of the full runs; a quick run's short trace may still be filling its
        batch)."""
        return steady_window(self.requests["arrival_time"])

    def _steps(self, steady: bool) -> pd.DataFrame:
        if not steady or self.steps.empty:
            return self.steps
        start, end = self.steady_window()
        t = self.steps["time"]
        return self.steps[(t >= start) & (t < end)]

    def mean_batch(self, memory_bound_only: bool = False, steady: bool = True) -> float:
        """Mean running requests per decode step (Fig. 13), time-weighted by step duration, over the steady-state
        window (``steady_window``; ``steady=False``: the whole run, ramp-up and drain included)."""
        d = self._steps(steady)
        d = d[d["kind"] == "decode"]
        if memory_bound_only:
            d = d[d["memory_bound"]]
        return float((d["num_running"] * d["dt"]).sum() / d["dt"].sum()) if len(d) else float("nan")

    def shares(self, memory_bound_only: bool = True, steady: bool = True) -> dict[str, float]:
        """Fig. 2: time-weighted share of KV slots in each kind, over the memory-bound steps of the steady-state
        window. With no memory-bound step every share is NaN (the breakdown describes a full memory; there is none
        to describe), never an average over all steps in disguise: ask for ``memory_bound_only=False`` to get
        that."""
        d = self._steps(steady)
        if memory_bound_only:
            d = d[d["memory_bound"]]
        cols = ["token_states", "reserved", "internal", "external"]
        if d.empty:
            return {c: math.nan for c in cols}
        tot = (d[cols].sum(axis=1) * d["dt"]).sum()
        return {c: float(100 * (d[c] * d["dt"]).sum() / tot) for c in cols}

    def memory_bound_share(self, steady: bool = True) -> float:
        """Share of steps (in the steady-state window) that are memory-bound."""
        d = self._steps(steady)
        return float(d["memory_bound"].mean()) if len(d) else float("nan")

    def prefill_steps(self, steady: bool = True) -> dict[str, float]:
        """How the steps (in the steady-state window) split into prefill and decode: the share of prefill steps
        (``step_share``), their share of the time (``time_share``) and the mean requests per prefill step
        (``requests_per_step``). The scheduler runs the prompts of the requests that can join as a step of their own
        (§4.2's iteration-level scheduling as vLLM implements it), and every step costs at least one read of the
        weights, so many small prefill steps cost throughput."""
        d = self._steps(steady)
        p = d[d["kind"] == "prefill"]
        if d.empty:
            return {"step_share": math.nan, "time_share": math.nan, "requests_per_step": math.nan}
        return {"step_share": len(p) / len(d), "time_share": float(p["dt"].sum() / d["dt"].sum()),
                "requests_per_step": float(p["num_batched"].mean()) if len(p) else math.nan}

    def normalized_latency(self) -> float:
        return normalized_latency(self.requests)

    def load(self) -> Load:
        """Arrivals, completions and normalized latency over the steady window (``capacity.Load``)."""
        return Load.of(self.requests)

    def sharing_saving(self, steady: bool = True) -> float:
        """Memory saved by sharing, ``1 - physical / logical`` blocks, time-weighted over the steady-state window
        (Fig. 15)."""
        d = self._steps(steady)
        return float(1 - (d["physical_blocks"] * d["dt"]).sum() / (d["logical_blocks"] * d["dt"]).sum())

    def throughput(self) -> float:
        return len(self.requests) / self.duration


#: the columns of ``SimResult.steps``, from each step's ``core.StepMetrics`` (``memory``: its ``KVStats``)
STEP_COLUMNS = ("step", "time", "dt", "kind", "num_running", "num_batched", "num_waiting", "num_swapped",
                "memory_bound", "max_request_waste", "token_states", "reserved", "internal", "external")
SHARING_COLUMNS = ("physical_blocks", "logical_blocks")  # paged only: Fig. 15's blocks with and without sharing


def steps_frame(steps: Sequence_[StepMetrics], paged: bool) -> pd.DataFrame:
    """``SimResult.steps``: one row per recorded ``StepMetrics`` (one tuple per step, turned into columns once; the
    fields are read as typed attributes, which the compiled simulator reads natively)."""
    rows = []
    for m in steps:
        k = cast(KVStats, m.memory)
        row = (m.step, m.time, m.step_time, m.kind, m.num_running, m.num_groups, m.num_waiting, m.num_swapped,
               m.memory_bound, k.max_request_waste, k.token_states, k.reserved, k.internal, k.external)
        rows.append(row + (k.physical_blocks, k.logical_blocks) if paged else row)
    if not rows:
        return pd.DataFrame()
    names = STEP_COLUMNS + (SHARING_COLUMNS if paged else ())
    return pd.DataFrame({name: np.array(col) for name, col in zip(names, zip(*rows))})  # same dtypes


class SimExecutor:
    """The simulator's executor (``core.Executor``, and ``runs.RunExecutor``: it knows each sequence's length from
    the trace): a step-time model on a simulated clock, no tensors.

    A step is charged ``CostModel.step_time`` (plus, with beams, its K/V copies: the copy-on-write blocks and Orca's
    context copies, ``CostModel.copy_time``; a prefill only for its uncached prompt tokens, or all of them with
    ``charge_cached``), and the clock moves by it. Each running sequence's next token is a dummy token, and a
    sequence stops at its trace's length (``stop_len``, set by the driver as requests arrive). With ``beam``
    (``BeamModel``, §4.4) each beam group that goes on is re-forked after every step by the beam model. It holds no
    KV manager: ``copy_unit`` is its block size (tokens per copied block: 1 for a contiguous manager's slots)."""

    fill_token = 0

    def __init__(self, cost: CostModel, block_size: int, copy_unit: int, beam: BeamModel | None = None, seed: int = 0,
                 charge_cached: bool = False) -> None:
        self.cost, self.block_size, self.copy_unit, self.beam = cost, block_size, copy_unit, beam
        self.beam_rng, self.charge_cached = random.Random(seed), charge_cached
        self.now = 0.0
        self.stop_len: dict[int, int] = {}  # seq_id -> its token count once its output is done
        self.computed = 0  # prompt tokens charged as computed

    def clock(self) -> float:
        return self.now

    def stop(self, s: Sequence, g: SequenceGroup) -> FinishReason | None:
        return "length" if len(s.token_ids) >= self.stop_len[s.seq_id] else None

    def steps_left(self, seqs: list[Sequence]) -> int:
        return min((self.stop_len[s.seq_id] - len(s.token_ids) for s in seqs), default=0)

    def steady_step(self, num_seqs: int, context_tokens: int) -> float:
        dt = self.cost.decode_time(num_seqs, context_tokens)  # ``decode_step_time`` with nothing swapped
        self.now += dt
        return dt

    def execute(self, plan: SchedulerOutputs) -> ModelOutput | None:
        if plan.is_empty():
            return None
        cost = self.cost
        nswap = len(plan.blocks_to_swap_in) + len(plan.blocks_to_swap_out)
        tokens: list[tuple[Sequence, SequenceGroup, int, float]] = []
        if plan.is_prefill:
            num_seqs, context = len(plan.prefill_groups), 0
            for g in plan.prefill_groups:
                seqs = g.get_seqs("running")
                context += len(seqs[0].token_ids)  # (forks share their prompt: computed once)
                for s in seqs:
                    tokens.append((s, g, 0, 0.0))
            dt = cost.step_time(plan, self.block_size)
        else:  # the step's context in the pass that gives each sequence its token (``CostModel.step_time``)
            context = 0
            for g in plan.decode_groups:
                for s in g.get_seqs("running"):
                    tokens.append((s, g, 0, 0.0))
                    context += len(s.token_ids)
            num_seqs = len(tokens)
            dt = cost.decode_step_time(num_seqs, context, nswap, self.block_size)
        if self.beam is not None:  # this step's copy-on-write blocks and the previous step's forks (slots, on Orca)
            dt += cost.copy_time(num_copied(plan.blocks_to_copy) * self.copy_unit)
        if plan.is_prefill:  # prompt tokens charged (computed): the uncached ones, or all of them in the ablation
            charged = context if self.charge_cached else plan.num_batched_tokens
            self.computed += charged
            if self.charge_cached:
                dt += cost.prefill_time(charged) - cost.prefill_time(plan.num_batched_tokens)
        self.now += dt
        output = ModelOutput(tokens=tokens, stop=self.stop, now=self.now, duration=dt, num_seqs=num_seqs,
                             context_tokens=context)
        if self.beam is not None:
            for g in plan.scheduled_groups:
                seqs = g.get_seqs("running")
                if any(len(s.token_ids) + 1 < self.stop_len[s.seq_id] for s in seqs):
                    output.forks += self.beam.forks(seqs, self.beam_rng, first=g.seqs[0].get_output_len() == 0)
        return output


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a replay runs (``simulate``'s decorator), and as it was before
    afterwards (so a replay within a replay leaves it off). A replay's objects stay alive until it returns (every
    step's record, every request), so collections find nothing: they took about a fifth of a recorded paper-scale
    replay (the engine core keeps a ``StepMetrics`` per step; ``benchmarks/sim_speed.py``). Not for replays in
    concurrent threads: the switch is the process's."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@gc_paused()
@compiled_when_built
def simulate(trace: list[TraceRequest], system: str = "paged", num_slots: int | None = None, block_size: int = 16,
             cost: CostModel | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
             max_model_len: int = 2048, preemption_mode: str = "recompute", num_cpu_blocks: int = 0,
             progress: bool = False, record_steps: bool = True, max_steps: int | None = None,
             placement: str = "buddy", n: int = 1, seed: int = 0, prompts: dict[str, list[int]] | None = None,
             prefix_lens: dict[str, int] | None = None, enable_prefix_caching: bool = False,
             charge_cached: bool = False, beam: BeamModel | None = None,
             equal_sample_lengths: bool = False) -> SimResult:
    """Replay a trace on the engine core (``core.EngineCore``) with the simulated executor (``SimExecutor``): the
    real scheduler and KV manager of ``system``, a step-time model, requests arriving on the simulated clock.

    With ``n > 1`` every request is a parallel-sampling group (§4.4): its ``n`` samples share the prompt's blocks,
    the first generates the trace's output length and the others lengths drawn (seeded) from the trace's outputs
    (``equal_sample_lengths=True``: every sample the trace's output length, an ablation that tells how much of a
    saving the independent draws cost; ``gain_sources.parallel_saving_causes``). With ``beam`` (``BeamModel``)
    every request is a beam-search group of ``beam.width`` beams, all as long as the trace's output (``n`` is
    ignored). Shared prefixes (§4.4, Fig. 16): ``prompts`` gives requests real token ids (otherwise every prompt is
    zeros), so that prefix hashes match; ``prefix_lens`` marks user-shared prefixes; ``enable_prefix_caching``
    finds them automatically. Runs of steady decode steps are taken at once (``runs.RunCore``) where
    neither beams nor prefixes are replayed."""
    kv = make_kv_manager(system, num_slots or paper_slots(), block_size,
                         max_model_len, num_cpu_blocks, placement=placement,
                         enable_prefix_caching=enable_prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                                      cast(PreemptionMode, preemption_mode)), kv, static_batching=SYSTEMS[system].static_batching)
    ex = SimExecutor(cost or CostModel(), block_size, kv.block_size, beam, seed, charge_cached)
    final_len: dict[int, int] = {}  # seq_id -> prompt + output (its final KV length)
    target: dict[int, int] = {}  # seq_id -> output length from the trace
    recorded = final_len if record_steps else None
    runs: RunCore | None = None  # the core's step, chosen once: with runs of steady decode steps where they apply
    if beam is None and not enable_prefix_caching and not prefix_lens:
        runs = RunCore(sched, ex, ex.clock, record_steps, final_len=recorded, max_steps=max_steps)
        core: EngineCore = runs
    else:
        core = EngineCore(sched, ex, ex.clock, record_steps, final_len=recorded)
    pending = sorted(trace, key=lambda r: r.arrival_time)
    n = beam.width if beam is not None else n
    rng, trace_outputs = np.random.default_rng(seed), np.array([r.output_len for r in trace])
    groups: list[SequenceGroup] = []
    i = 0
    bar = tqdm(total=len(pending), desc=f"sim {system}", disable=not (progress and interactive()), leave=False)
    while i < len(pending) or core.has_unfinished():
        if not core.has_unfinished() and pending[i].arrival_time > ex.now:
            ex.now = pending[i].arrival_time  # idle until the next arrival
        while i < len(pending) and pending[i].arrival_time <= ex.now:  # the arrivals, as groups of n sequences
            r = pending[i]
            room = max_model_len - r.prompt_len
            lens = [r.output_len] * n if n == 1 or beam is not None or equal_sample_lengths else \
                [r.output_len] + [min(int(x), room) for x in rng.choice(trace_outputs, n - 1)]
            tokens = prompts[r.request_id] if prompts else [0] * r.prompt_len
            seqs = [Sequence(len(target) + k, tokens) for k in range(n)]
            g = SequenceGroup(r.request_id, seqs, SamplingParams(n=n, max_tokens=max(lens), ignore_eos=True),
                              arrival_time=r.arrival_time)
            g.prefix_len = (prefix_lens or {}).get(r.request_id, 0)
            for s, out_len in zip(seqs, lens):
                target[s.seq_id], final_len[s.seq_id] = out_len, r.prompt_len + out_len
                ex.stop_len[s.seq_id] = len(tokens) + out_len
            groups.append(g)
            core.add(g)
            i += 1
        plan, done = core.step()
        if done or plan is not None and plan.ignored:
            bar.update(len(done) + (len(plan.ignored) if plan is not None else 0))
        if plan is not None and plan.is_empty():  # nothing could run: wait for the next arrival
            if i < len(pending):
                ex.now = max(ex.now, pending[i].arrival_time)
                continue
            if core.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests left (a request can never fit?)")
            break
        if max_steps is not None and core.num_steps >= max_steps:
            break
    bar.close()
    reqs = pd.DataFrame([{"request_id": g.request_id, "arrival_time": g.metrics.arrival_time,
                          "first_token_time": g.metrics.first_token_time, "finish_time": g.metrics.finish_time,
                          "prompt_len": g.seqs[0].get_prompt_len(), "output_len": target[g.seqs[0].seq_id],
                          "total_output_len": sum(target[s.seq_id] for s in g.seqs),
                          "error": g.error} for g in groups])
    return SimResult(system, steps_frame(core.steps, system == "paged"), reqs, dict(sched.num_preemptions),
                     kv.stats().prefix_hit_rate, ex.computed, runs.num_steady_steps if runs is not None else 0)
