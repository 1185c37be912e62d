"""Notebooks 01, 03, 04 and 05 in the open: one short replay at paper scale, its figures, and a live knob.

Each notebook walks one representative replay before its sweep (a short trace, the real scheduler and KV managers in
``pagedattn.repro.sim.simulator``, OPT-13B on an A100-40GB), and ends with an *explore* section: an ipywidgets control that reruns
that replay for the value chosen and redraws its figure. The pieces:

- ``short_trace`` / ``lengths_figure``: the trace and its lengths (the paper's Fig. 11);
- ``replay``: one system on it (``sim.simulate`` on the paper's KV budget);
- the figures of one replay: ``kv_usage_figure`` (Fig. 2's four kinds of KV slots over time), ``queue_figure``
  (the capacity rule of ``pagedattn.repro.sim.capacity``: requests in the system over the steady window, §6.2),
  ``sharing_figure`` (Fig. 15's blocks with and without sharing);
- ``ProbeLog``: a replay function that records every probe of a sustainable-rate search;
- ``Explorer``: controls + a figure redrawn on every change; one constructor per notebook (``kv_waste``,
  ``throughput``, ``sharing``, ``block_size``). Displayed, an explorer also carries a PNG of its figure, which a
  reader without a kernel sees instead of the widget (as ``tour.BlockPoolView`` does).
"""
from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from pagedattn.repro.report import plots
from pagedattn.repro.sim.capacity import NL_THRESHOLD_S, Load
from pagedattn.repro.paper import paper_slots
from pagedattn.repro.experiments.kv_waste import FIG2_RATE_GRID, kv_waste_pct
from pagedattn.repro.experiments.throughput import SimParams
from pagedattn.repro.paper import DEFAULT_BLOCK_SIZE, FIG13_MEAN_BATCH
from pagedattn.repro.sim.simulator import BEAM_DISTINCT_PARENTS, LABELS, BeamModel, CostModel, SimResult, simulate
from pagedattn.repro.workloads.traces import TraceRequest, make_trace, with_rate

import matplotlib.pyplot as plt  # noqa: E402  (after plots, which selects a headless backend outside a kernel)

#: requests in an explorer's trace: a replay takes well under a second (quick runs: fewer still)
REQUESTS = {"sharegpt": 400, "alpaca": 300}
QUICK_REQUESTS = {"sharegpt": 100, "alpaca": 100}
KINDS = tuple(plots.KIND_COLORS)
#: swap space for multi-sequence groups, which vLLM preempts by swapping (§4.5), as notebook 04's replays do
CPU_BLOCKS = 2000
#: the beam widths the simulator's beam model was measured at
BEAM_WIDTHS = tuple(BEAM_DISTINCT_PARENTS)


def short_trace(name: str, rate: float, quick: bool = False, seed: int = 0) -> list[TraceRequest]:
    """A short seeded trace of ``name`` (``workloads.make_trace``) with Poisson arrivals at ``rate`` req/s."""
    return make_trace(name, (QUICK_REQUESTS if quick else REQUESTS)[name], rate, seed)


def lengths_figure(trace: list[TraceRequest], title: str = ""):
    """Histograms of the trace's prompt and output lengths (tokens), their means marked (the paper's Fig. 11)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.6), sharey=True)
    for ax, (what, lens) in zip(axes, (("prompt", [r.prompt_len for r in trace]),
                                       ("output", [r.output_len for r in trace]))):
        ax.hist(lens, bins=30, color="#3b75af")
        ax.axvline(float(np.mean(lens)), color="k", lw=1, ls="--", label=f"mean {np.mean(lens):.0f}")
        ax.set(xlabel=f"{what} length (tokens)", ylabel="requests")
        ax.legend(fontsize=8)
    fig.suptitle(title or f"{len(trace)} requests", fontsize=10)
    fig.tight_layout()
    return fig


def replay(trace: list[TraceRequest], system: str = "paged", block_size: int = DEFAULT_BLOCK_SIZE, n: int = 1,
           beam_width: int = 1, cost: CostModel | None = None) -> SimResult:
    """One replay of ``trace`` through ``system`` on the paper's KV budget (OPT-13B / A100-40GB, ``sim.simulate``).
    ``n > 1``: parallel sampling; ``beam_width > 1``: beam search with the measured beam model (§4.4). Preemption
    follows vLLM's rule, the scheduler's default (§4.5): a single-sequence group is recomputed, a multi-sequence group
    swapped to ``CPU_BLOCKS`` of CPU memory."""
    return simulate(trace, system, paper_slots(), block_size, cost or CostModel(), n=n,
                    beam=BeamModel.measured(beam_width) if beam_width > 1 else None, num_cpu_blocks=CPU_BLOCKS)


def _steady_span(ax, r: SimResult) -> None:
    """The run's steady window (``SimResult.steady_window``) between two dotted lines."""
    start, end = r.steady_window()
    if math.isfinite(end):
        ax.axvline(start, color="k", ls=":", lw=1.2, label="steady window")
        ax.axvline(end, color="k", ls=":", lw=1.2)


def kv_usage_figure(r: SimResult, title: str = ""):
    """The four kinds of KV slots (Fig. 2) stacked over the run, as a share of the KV budget, with the steady
    window marked and the requests running and waiting below."""
    d = r.steps
    fig, (ax, aq) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    total = d[list(KINDS)].sum(axis=1)
    ax.stackplot(d["time"], *[100 * d[k] / total for k in KINDS], colors=list(plots.KIND_COLORS.values()),
                 labels=[plots.KIND_LABELS[k] for k in KINDS])
    _steady_span(ax, r)
    ax.set(ylabel="share of KV slots (%)", ylim=(0, 100), title=title)
    ax.legend(fontsize=7, loc="lower right", ncol=5)
    aq.plot(d["time"], d["num_running"], label="running")
    aq.plot(d["time"], d["num_waiting"], label="waiting")
    aq.set(xlabel="time (s)", ylabel="requests")
    aq.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def in_system(requests: pd.DataFrame, t) -> np.ndarray:
    """Requests arrived and not finished at each time of ``t``."""
    return (np.searchsorted(np.sort(requests["arrival_time"]), t, "right")
            - np.searchsorted(np.sort(requests["finish_time"]), t, "right"))


def queue_figure(r: SimResult, threshold_s: float = NL_THRESHOLD_S, title: str = ""):
    """The capacity rule of one probe (``capacity.Load``): requests in the system over the run, the steady window
    marked, and the least-squares line whose slope is the queue growth (§6.2); the title gives the probe's normalized
    latency, queue growth and verdict."""
    req, load = r.requests, r.load()
    t = np.linspace(0.0, r.duration, 400)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(t, in_system(req, t), color="#3b75af", label="requests in the system")
    _steady_span(ax, r)
    start, end = r.steady_window()
    if math.isfinite(end):
        tw = np.linspace(start, end, 256, endpoint=False)
        mid = float(in_system(req, tw).mean())  # a least-squares line passes through the means
        ax.plot(tw, mid + load.queue_growth * (tw - tw.mean()), "k--",
                label=f"fit: slope {load.queue_growth:+.2f} req/s")
    ax.set(xlabel="time (s)", ylabel="requests", title=title or verdict_line(load, threshold_s))
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def verdict_line(load: Load, threshold_s: float = NL_THRESHOLD_S) -> str:
    """One probe in words: arrival rate, normalized latency, queue growth and the verdict of both rules."""
    return (f"arrivals {load.arrival_rate:.2f} req/s: normalized latency {load.normalized_latency_s:.3f} s/token, "
            f"queue growth {load.queue_growth:+.2f} req/s -> {load.verdict(threshold_s)}")


def sharing_figure(r: SimResult, title: str = ""):
    """Fig. 15's measure over the run: physical blocks in use (shared blocks counted once) against the blocks the
    same sequences would hold without sharing; the title gives the time-weighted saving over the steady window."""
    d = r.steps
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(d["time"], d["logical_blocks"], color="#e4572e", label="without sharing (logical)")
    ax.plot(d["time"], d["physical_blocks"], color="#4c9a2a", label="with sharing (physical)")
    _steady_span(ax, r)
    ax.set(xlabel="time (s)", ylabel="KV blocks",
           title=title or f"memory saved by sharing: {100 * r.sharing_saving():.1f} % (steady window)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


@dataclass
class ProbeLog:
    """A replay function for ``capacity.sustainable_rate`` that records every probe: rate, ``Load`` and verdict.
    ``replay(rate)`` returns the per-request frame of one replay at ``rate`` (``inf``: every request at t = 0)."""

    replay: Callable[[float], pd.DataFrame]
    threshold_s: float = NL_THRESHOLD_S
    probes: list = field(default_factory=list)

    def __call__(self, rate: float) -> pd.DataFrame:
        requests = self.replay(rate)
        load = Load.of(requests)
        self.probes.append({"probe": len(self.probes) + 1, "rate": rate,
                            "normalized_latency_s": load.normalized_latency_s, "queue_growth": load.queue_growth,
                            "completion_rate": load.completion_rate, "verdict": load.verdict(self.threshold_s)})
        return requests

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.probes)


def figure_png(fig) -> bytes:
    """A figure as PNG bytes (the figure is closed afterwards)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


class Explorer:
    """Controls and a figure: changing a control calls ``draw(**values)`` (one replay and its figure, returned as
    ``(figure, caption)``) and shows the new figure. Drawn figures are kept per setting, so going back is
    instant. ``explorer.widget`` is the ipywidgets box; ``explorer.set(name=value)`` moves a control as a reader
    does. Displayed in a notebook, the explorer also carries a PNG of its current figure for a reader without a
    kernel (``_repr_mimebundle_``)."""

    def __init__(self, controls: dict, draw: Callable[..., tuple]) -> None:
        import ipywidgets as w

        self.controls, self.draw = controls, draw
        self._drawn: dict[tuple, tuple[bytes, str]] = {}
        self.image = w.Image(format="png", layout=w.Layout(max_width="760px"))
        self.caption = w.HTML()
        for c in controls.values():
            c.observe(lambda change: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox(list(controls.values())), self.caption, self.image])
        self.redraw()

    def values(self) -> dict:
        return {name: c.value for name, c in self.controls.items()}

    def redraw(self) -> None:
        key = tuple(self.values().items())
        if key not in self._drawn:
            fig, caption = self.draw(**self.values())
            self._drawn[key] = figure_png(fig), caption
        png, caption = self._drawn[key]
        self.image.value, self.caption.value = png, f'<div class="pa-explore-caption">{caption}</div>'

    def set(self, **values) -> None:
        for name, v in values.items():
            self.controls[name].value = v

    @property
    def png(self) -> bytes:
        return self._drawn[tuple(self.values().items())][0]

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The widget for a live kernel, plus the current figure as PNG for a reader without one."""
        bundle = self.widget._repr_mimebundle_()
        bundle["image/png"] = base64.b64encode(self.png).decode()
        return bundle


def _slider(label: str, options, value):
    import ipywidgets as w

    return w.SelectionSlider(options=list(options), value=value, description=label, continuous_update=False,
                             layout=w.Layout(width="420px"))


def _buttons(label: str, options: dict, value):
    import ipywidgets as w

    return w.ToggleButtons(options=[(v, k) for k, v in options.items()], value=value, description=label)


def kv_waste(quick: bool = False, rate: float = max(FIG2_RATE_GRID), trace_name: str = "sharegpt",
             block_sizes=(1, 4, 16, 64, 256)) -> Explorer:
    """Notebook 01: pick a system (and the paged system's block size); one replay of a short trace at ``rate``,
    redrawn as Fig. 2's four kinds of KV slots over time. The caption gives the token-state share over the
    memory-bound steps of the steady window (``SimResult.shares``)."""
    trace = short_trace(trace_name, rate, quick)

    def draw(system: str, block_size: int):
        r = replay(trace, system, block_size)
        sh = r.shares()
        label = LABELS[system] + (f", block size {block_size}" if system == "paged" else "")
        shares = (f"token states {sh['token_states']:.1f} % of KV memory over the memory-bound steps of the steady "
                  f"window ({100 * r.memory_bound_share():.0f} % of its steps)" if not math.isnan(sh["token_states"])
                  else "memory never binds in the steady window (no breakdown to report)")
        caption = f"<b>{label}</b> at {rate:g} req/s: {shares}, mean batch {r.mean_batch():.1f} requests"
        return kv_usage_figure(r, f"{label}: KV slots over time ({len(trace)} requests, {rate:g} req/s)"), caption

    return Explorer({"system": _buttons("system", {s: LABELS[s] for s in ("orca_max", "orca_pow2", "orca_oracle",
                                                                          "paged")}, "paged"),
                     "block_size": _slider("block size", block_sizes, DEFAULT_BLOCK_SIZE)}, draw)


def throughput(quick: bool = False, rates=tuple(SimParams().rates["sharegpt"]),
               rate: float = FIG13_MEAN_BATCH["sharegpt"]["rate"],
               trace_name: str = "sharegpt", threshold_s: float = NL_THRESHOLD_S) -> Explorer:
    """Notebook 03: pick a request rate and a system; one replay (one probe of a sustainable-rate search), redrawn
    as the capacity rule sees it (``queue_figure``); the caption gives the probe's verdict."""
    base = short_trace(trace_name, 1.0, quick)

    def draw(rate: float, system: str):
        r = replay(with_rate(base, rate), system)
        load = r.load()
        return (queue_figure(r, threshold_s, f"{LABELS[system]} at {rate:g} req/s ({len(base)} requests)"),
                f"<b>{LABELS[system]}</b>: {verdict_line(load, threshold_s)}")

    return Explorer({"rate": _slider("rate (req/s)", rates, rate),
                     "system": _buttons("system", {s: LABELS[s] for s in ("orca_max", "orca_oracle", "paged")},
                                        "paged")}, draw)


def sharing(quick: bool = False, rate: float = FIG13_MEAN_BATCH["alpaca"]["rate"], trace_name: str = "alpaca",
            widths=(1, *BEAM_WIDTHS)) -> Explorer:
    """Notebook 04: pick parallel sampling or beam search and its width (n samples or beams); one paged replay of a
    short trace at ``rate``, redrawn as Fig. 15's blocks with and without sharing. Width 1 is a plain request; beam
    widths are those the simulator's beam model was measured at (``sim.BEAM_DISTINCT_PARENTS``)."""
    trace = short_trace(trace_name, rate, quick)

    def draw(method: str, width: int):
        r = replay(trace, n=width if method == "parallel" else 1, beam_width=width if method == "beam" else 1)
        what = f"{method}, {'n' if method == 'parallel' else 'beam width'} {width}"
        return (sharing_figure(r, f"{what} ({len(trace)} requests, {rate:g} req/s): saved "
                                  f"{100 * r.sharing_saving():.1f} %"),
                f"<b>{what}</b>: sharing saves {100 * r.sharing_saving():.1f} % of the KV blocks (time-weighted "
                f"over the steady window); mean batch {r.mean_batch():.1f} requests, "
                f"{sum(r.num_preemptions.values())} preemptions")

    return Explorer({"method": _buttons("method", {"parallel": "parallel sampling", "beam": "beam search"},
                                        "parallel"),
                     "width": _slider("n / width", widths, 4)}, draw)


def block_size(quick: bool = False, rate: float = 3.0, trace_name: str = "sharegpt", block_sizes=None) -> Explorer:
    """Notebook 05: pick a block size; one paged replay of a short trace at ``rate`` (memory effects only, no kernel
    multiplier), redrawn as Fig. 2's kinds of KV slots over time; the caption gives normalized latency, the share of
    allocated slots holding no token (internal fragmentation, §4.2) and the mean batch. ``rate``: a knob, by default
    one at which memory binds on the short ShareGPT trace (below it, every block size replays alike). Block sizes:
    notebook 05's sweep (``experiments.block_size``, imported here: it loads torch)."""
    from pagedattn.repro.experiments import block_size as bsx

    trace = short_trace(trace_name, rate, quick)

    def draw(block_size: int):
        r = replay(trace, block_size=block_size)
        waste = kv_waste_pct(r)
        return (kv_usage_figure(r, f"block size {block_size} ({len(trace)} requests, {rate:g} req/s)"),
                f"<b>block size {block_size}</b>: normalized latency {r.normalized_latency():.3f} s/token; "
                f"{waste:.1f} % of allocated slots hold no token; mean batch {r.mean_batch():.1f} requests, "
                f"{sum(r.num_preemptions.values())} preemptions")

    return Explorer({"block_size": _slider("block size", block_sizes or bsx.BLOCK_SIZES, DEFAULT_BLOCK_SIZE)}, draw)
