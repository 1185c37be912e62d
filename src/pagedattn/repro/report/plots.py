"""Shared plotting (matplotlib + seaborn): paper-vs-ours figures labelled with hardware, model and date."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # headless outside a notebook kernel
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

KIND_COLORS = {"token_states": "#4c9a2a", "reserved": "#f2b134", "internal": "#e4572e", "external": "#8a8a8a"}
KIND_LABELS = {"token_states": "token states", "reserved": "reserved", "internal": "internal frag.",
               "external": "external frag. & free"}


#: the widest a saved figure may be (pixels at savefig's dpi); tests/test_figures.py checks every committed figure
MAX_WIDTH_PX = 2400
SAVE_DPI = 130


def wrap_to_width(text: str, width_in: float, fontsize: float = 7) -> str:
    """``text`` wrapped (on words, keeping its own line breaks) so that no line is wider than ``width_in`` inches at
    ``fontsize`` points: an average DejaVu Sans character is about 0.55 em wide, so 0.6 em keeps a margin."""
    import textwrap
    chars = max(20, int(width_in * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars, break_long_words=True, break_on_hyphens=False) if line else ""
                     for line in text.split("\n"))


def footnote(fig, text: str) -> None:
    """Label a figure with where its numbers come from (hardware, model, date), below the axes and wrapped to the
    figure's width, so that a long label neither widens the saved canvas (``bbox_inches="tight"``) nor overlaps a
    legend or an axis label."""
    width = fig.get_figwidth() * 0.97
    fig.text(0.01, 0.0, wrap_to_width(text, width), fontsize=7, color="#555555", ha="left", va="top")


def record_paper_marks(fig, *values) -> None:
    """Note on ``fig`` the paper's values it marks (numbers; a ``(lo, hi)`` range adds both), for :func:`savefig`'s
    record. Called by :func:`mark_paper` and the figure helpers here that draw the paper's values."""
    marks = fig.__dict__.setdefault("_paper_marks", [])
    for v in values:
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if x is not None and isinstance(x, (int, float)) and not isinstance(x, bool) and x not in marks:
                marks.append(float(x))


def mark_paper(ax, value, axis: str = "y", label: str | None = "paper", span: tuple | None = None, **kw):
    """Draw the paper's ``value`` on ``ax`` and record it on the figure (:func:`record_paper_marks`): a dashed dark
    line across the axes (``axis`` ``"y"``: horizontal at ``value``; ``"x"``: vertical), or only over ``span``
    (``(x0, x1)`` in data coordinates, e.g. one bar group), or a shaded band for a ``(lo, hi)`` range. ``label``
    names it in the legend. Returns the artist."""
    style = {"color": PAPER_COLOR, "ls": "--", "lw": 1.5, "zorder": 6, **kw}
    if isinstance(value, (tuple, list)):
        lo, hi = value
        band = {"color": style.pop("color"), "alpha": kw.get("alpha", 0.15), "zorder": 0.8}
        art = (ax.axhspan if axis == "y" else ax.axvspan)(lo, hi, label=label, **band)
    elif span is not None:
        x0, x1 = span
        art = (ax.plot([x0, x1], [value, value], label=label, **style) if axis == "y"
               else ax.plot([value, value], [x0, x1], label=label, **style))[0]
    else:
        art = (ax.axhline if axis == "y" else ax.axvline)(value, label=label, **style)
    record_paper_marks(ax.figure, value)
    return art


#: The PNG text chunk holding a figure's record (read by tests/test_plots.py and the figure test).
FIGURE_META_KEY = "pagedattn"


def figure_record(fig, figure: str | None = None, paper_marks: list | None = None) -> dict:
    """What a saved figure states about itself: the paper's figure it reproduces, the paper's values it marks, and
    per axes its x/y scale and how many data artists it draws (0 = an empty chart)."""
    def base(axis) -> float | None:
        return float(getattr(axis.get_transform(), "base", 0) or 0) or None

    axes = [{"xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
             "xbase": base(ax.xaxis) if ax.get_xscale() == "log" else None,
             "ybase": base(ax.yaxis) if ax.get_yscale() == "log" else None,
             "artists": artist_count(ax)}
            for ax in fig.axes if ax.get_visible() and ax.axison]
    marks = list(paper_marks or [])
    marks += [m for m in fig.__dict__.get("_paper_marks", []) if m not in marks]
    return {"figure": figure, "paper_marks": marks, "axes": axes}


def artist_count(ax) -> int:
    """The data artists an axes draws (lines, patches, collections, images); 0 is an empty chart."""
    return len(ax.lines) + len(ax.patches) + len(ax.collections) + len(ax.images)


def empty_axes(fig) -> list:
    """The visible axes of ``fig`` (with their axis drawn) that draw nothing."""
    return [ax for ax in fig.axes if ax.get_visible() and ax.axison and artist_count(ax) == 0]


def savefig(fig, path: str | Path, figure: str | None = None, paper_marks: list | None = None) -> Path:
    """Save ``fig`` as a PNG whose text chunk ``FIGURE_META_KEY`` records :func:`figure_record` (JSON): ``figure``
    is the paper's figure it reproduces (``"Fig. 16"``), ``paper_marks`` the paper's values it marks, besides those
    recorded on ``fig`` by :func:`mark_paper` / :func:`record_paper_marks`. Refuses a figure with an empty axes
    (nothing to show must not be saved as a chart) and warns when the canvas is wider than :data:`MAX_WIDTH_PX`."""
    import json
    import warnings
    if empty_axes(fig):
        raise ValueError(f"{Path(path).name}: {len(empty_axes(fig))} axes draw nothing; do not save an empty chart")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = figure_record(fig, figure, paper_marks)
    fig.savefig(path, dpi=SAVE_DPI, bbox_inches="tight", metadata={FIGURE_META_KEY: json.dumps(record)})
    from PIL import Image
    with Image.open(path) as im:
        if im.size[0] > MAX_WIDTH_PX:
            warnings.warn(f"{path.name} is {im.size[0]} px wide (> {MAX_WIDTH_PX})", stacklevel=2)
    return path


def stacked_shares(df: pd.DataFrame, title: str, label: str = ""):
    """Horizontal stacked bars of KV slot shares. ``df``: index = bar names, columns = the four kinds (percent)."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(df) + 1.6))
    left = pd.Series(0.0, index=df.index)
    for kind, color in KIND_COLORS.items():
        vals = df[kind].fillna(0.0)
        ax.barh(df.index, vals, left=left, color=color, label=KIND_LABELS[kind], edgecolor="white")
        for y, (v, l0) in enumerate(zip(vals, left)):
            if v >= 4:
                ax.text(l0 + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=8, color="white")
        left += vals
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_xlabel("share of KV memory (%)")
    ax.set_title(title)
    ax.legend(ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, frameon=False)
    if label:
        footnote(fig, label)
    fig.tight_layout()
    return fig


# --- Latency-vs-rate figures (Figs. 12 and 14) and the sharing figures (Figs. 14-15) ---------------------------------
# Every system keeps one colour, marker and line style on every panel, so that two systems on the same points (Orca
# (Oracle) and ours where memory does not bind) both stay visible: the later-drawn one dashed over the solid one.
SYSTEM_STYLES = {
    "FasterTransformer": {"color": "#3b75af", "marker": "v", "ls": (0, (1, 1)), "ms": 6},
    "Orca (Max)": {"color": "#ef8636", "marker": "s", "ls": "-.", "ms": 5},
    "Orca (Pow2)": {"color": "#519e3e", "marker": "D", "ls": (0, (5, 1, 1, 1, 1, 1)), "ms": 5},
    "Orca (Oracle)": {"color": "#c53a32", "marker": "o", "ls": "--", "ms": 7, "mfc": "none", "mew": 1.6},
    "vLLM (ours)": {"color": "#8d69b8", "marker": "o", "ls": "-", "ms": 4, "lw": 3.2, "alpha": 0.75},
    "vLLM-CPU": {"color": "#17a2b8", "marker": "P", "ls": "-", "ms": 6},  # vLLM's own server (notebook 13)
}
#: the order systems are drawn in: ours first (at the bottom, wide), so that the others stay visible over it
DRAW_ORDER = ("vLLM (ours)", "Orca (Oracle)", "Orca (Pow2)", "Orca (Max)", "FasterTransformer")
TRACE_TITLES = {"sharegpt": "ShareGPT (real, OPT tokens)", "sharegpt_synthetic": "ShareGPT-like (synthetic)",
                "alpaca": "Alpaca (synthetic)"}
PAPER_COLOR = "#222222"


def _style(label: str, i: int = 0) -> dict:
    default = {"color": sns.color_palette()[i % 10], "marker": "o", "ls": "-", "ms": 5}
    return {"lw": 1.6, "alpha": 1.0, "mfc": None, "mew": 1.0, **SYSTEM_STYLES.get(label, default)}


def latency_vs_rate(ax, d: pd.DataFrame, threshold: float, ymax: float, x: str = "rate",
                    y: str = "normalized_latency_s", hue: str = "label") -> None:
    """One Fig. 12/14 panel on a linear latency axis (as the paper's) from 0 to ``ymax``: each ``hue`` group's curve
    in its own style; a point above ``ymax`` is drawn as an open up-triangle in a grey strip above the scale (its line
    clipped there), each such system on its own row of the strip, so that a system off the scale is still on the panel
    and two systems off the scale at the same rates do not hide each other; the threshold as a dotted grey line."""
    groups = dict(list(d.groupby(hue, sort=False)))
    order = [g for g in DRAW_ORDER if g in groups] + [g for g in groups if g not in DRAW_ORDER]
    rows = [g for g in order if (groups[g][y] > ymax).any()]
    row_h = 0.05 * ymax
    for i, g in enumerate(order):
        s, c = _style(g, i), groups[g].sort_values(x)
        top = ymax + row_h * (rows.index(g) + 0.6) if g in rows else ymax
        yy = c[y].where(c[y] <= ymax, top)
        ax.plot(c[x], yy, color=s["color"], ls=s["ls"], lw=s["lw"], alpha=s["alpha"], marker=s["marker"],
                ms=s["ms"], mfc=s["mfc"] or s["color"], mew=s["mew"], label=g, zorder=2 + i)
        off = c[y] > ymax
        if off.any():
            ax.plot(c.loc[off, x], [top] * int(off.sum()), ls="none", marker="^", ms=8, mfc="white",
                    mec=s["color"], mew=1.6, zorder=10 + i, clip_on=False)
    ax.axhline(threshold, color="#888888", ls=":", lw=1, label=f"threshold {threshold:.3g} s/token", zorder=1)
    ticks = [v for v in matplotlib.ticker.MaxNLocator(6).tick_values(0, ymax) if 0 <= v <= ymax * (1 + 1e-9)]
    if rows:
        ax.axhspan(ymax, ymax + row_h * (len(rows) + 0.2), color="#e6e6e6", zorder=0.5, lw=0)
    ax.set_ylim(0, ymax + row_h * (len(rows) + 0.2) if rows else ymax)
    ax.set_yticks(ticks)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")


def off_scale_handle(ymax: float):
    """The legend entry of :func:`latency_vs_rate`'s off-scale marker."""
    from matplotlib.lines import Line2D
    return Line2D([], [], ls="none", marker="^", ms=8, mfc="white", mec="#555555", mew=1.6,
                  label=f"above {ymax:.3g} s/token (grey strip, one row per system)")


def mark_sustainable(ax, sustainable: pd.DataFrame, threshold: float) -> None:
    """Where each system's sustainable rate lies on a latency-rate panel, so that a curve swept only below it still
    shows where its ratio is read (issue 61): a diamond in the system's colour on the ``threshold`` line at its
    ``sustainable_rate`` (open where ``which`` is ``"predicted"``: the simulator's) and a dotted line down to the
    axis; the x axis widened to take them in. ``sustainable``: one row per system, with ``label`` and
    ``sustainable_rate``."""
    for i, row in enumerate(sustainable.to_dict("records")):
        s = _style(row["label"], i)
        filled = row.get("which", "measured") != "predicted"
        ax.plot([row["sustainable_rate"]] * 2, [0, threshold], color=s["color"], ls=":", lw=1, zorder=1.6)
        ax.plot([row["sustainable_rate"]], [threshold], ls="none", marker="D", ms=7, mec=s["color"], mew=1.4,
                mfc=s["color"] if filled else "white", zorder=21, clip_on=False)
    ax.set_xlim(0, max(ax.get_xlim()[1], 1.05 * float(sustainable.sustainable_rate.max())))


def sustainable_handle():
    """The legend entry of :func:`mark_sustainable`'s diamonds."""
    from matplotlib.lines import Line2D
    return Line2D([], [], ls="none", marker="D", ms=7, mfc="#555555", mec="#555555",
                  label="sustainable rate, where the ratio is read (open: simulator)")


def mark_paper_ratio(ax, base_rate: float, ratio: tuple, threshold: float, color: str, label: str,
                     side: int = 0) -> None:
    """The paper's rate ratio on a latency-rate panel: where ours would reach ``threshold`` if its sustainable rate
    were ``ratio`` (a ``(lo, hi)`` range, or one value) times ``base_rate`` (the other system's measured sustainable
    rate): a hatched bar along the threshold line (``side`` 1 / -1: just above / below it, so that two ranges do not
    overlap), or a star for one value, in the legend as ``label``."""
    lo, hi = (ratio, ratio) if not isinstance(ratio, (tuple, list)) else ratio
    if lo is None or base_rate is None or not math.isfinite(base_rate):
        return
    record_paper_marks(ax.figure, lo, hi)
    y0, y1 = ax.get_ylim()
    h = 0.035 * (y1 - y0)
    if hi == lo:
        ax.plot([lo * base_rate], [threshold], ls="none", marker="*", ms=15, mfc=color, mec=PAPER_COLOR, mew=0.8,
                label=label, zorder=20)
    else:
        a, b = (threshold - h, threshold + h) if side == 0 else sorted((threshold, threshold + 2 * h * side))
        ax.fill_between([lo * base_rate, hi * base_rate], a, b, color=color, alpha=0.28,
                        hatch="///", edgecolor=PAPER_COLOR, lw=0.6, label=label, zorder=1.5)


def setup_title(sel: dict) -> str:
    """A Fig. 12 panel's title: the model with its GPUs (Table 1) and the trace, e.g. ``OPT-13B (1 x A100-40GB),
    ShareGPT (real, OPT tokens)``."""
    from pagedattn.repro.paper import GPUS
    model, trace = sel.get("model", "OPT-13B"), sel.get("trace", "")
    gpus, gb = GPUS[model]
    return f"{model} ({gpus} x A100-{gb}GB), {TRACE_TITLES.get(trace, trace)}"


def _paper_ratio_label(other: str, ratio) -> str:
    r = f"{ratio[0]:g}-{ratio[1]:g}x" if isinstance(ratio, (tuple, list)) else f"{ratio:g}x"
    return f"paper: ours at {r} {other}'s rate"


def fig12_panels(curves: pd.DataFrame, sustainable: pd.DataFrame | None, threshold: float,
                 paper_ratios: dict | None = None, panels: list[tuple] | None = None, title_of=None,
                 ymax: float = 1.0, label: str = "", legend_cols: int | None = None, mark_rates: bool = False):
    """Fig. 12: normalised latency against request rate, one panel per ``panels`` entry (a dict of column values
    selecting ``curves``' rows, e.g. ``{"model": "OPT-13B", "trace": "sharegpt"}``), on the paper's linear axis.

    ``paper_ratios`` (``paper.FIG12_RATE_RATIO``: ``"paged_vs_<system>" -> (lo, hi)``, used on ShareGPT panels only,
    where the paper gives them) marks where ours would cross the threshold at the paper's ratio over that system's
    sustainable rate in ``sustainable`` (same selection columns, ``system``, ``sustainable_rate``). ``mark_rates``:
    each system's sustainable rate from ``sustainable`` is marked on the threshold (:func:`mark_sustainable`), for
    curves that stop short of it. ``title_of`` maps a panel's selection to its title (default: its values joined).
    One legend for the figure, below the panels."""
    from pagedattn.repro.sim.simulator import LABELS
    if panels is None:
        panels = [{"trace": w} for w in dict.fromkeys(curves.trace)]
    title_of = title_of or (lambda sel: ", ".join(TRACE_TITLES.get(v, str(v)) for v in sel.values()))
    setups = len({tuple(v for k, v in p.items() if k != "trace") for p in panels})
    ncols = setups if setups > 1 else len(panels)  # one column per setup, or the traces side by side
    nrows = math.ceil(len(panels) / ncols)
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.5 * nrows + 0.9), squeeze=False)
    handles = {}
    for ax, sel in zip(axes.flat, panels):
        d = curves
        for k, v in sel.items():
            d = d[d[k] == v]
        latency_vs_rate(ax, d, threshold, ymax)
        s = sustainable
        for k, v in (sel.items() if s is not None else ()):
            s = s[s[k] == v]
        if mark_rates and s is not None and len(s):
            mark_sustainable(ax, s, threshold)
        if paper_ratios and sustainable is not None and str(sel.get("trace", "")).startswith("sharegpt"):
            rates = s.set_index("system")["sustainable_rate"]
            marks = [(k.removeprefix("paged_vs_"), r) for k, r in paper_ratios.items()
                     if isinstance(r, (tuple, list)) and r[0] is not None and k.removeprefix("paged_vs_") in rates]
            for i, (other, ratio) in enumerate(marks):
                mark_paper_ratio(ax, float(rates[other]), ratio, threshold, _style(LABELS[other])["color"],
                                 _paper_ratio_label(LABELS[other], ratio), side=(1 if i == 0 else -1) if len(marks) > 1 else 0)
        ax.set_xlim(left=0)  # after the paper's marks, so that the axis takes them in
        ax.set_title(title_of(sel), fontsize=10)
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if mark_rates and sustainable is not None:
        handles["sustainable"] = sustainable_handle()
    handles["off scale"] = off_scale_handle(ymax)
    _figure_legend(fig, handles, ncols, nrows, legend_cols)
    if label:
        footnote(fig, label)
    return fig


def _figure_legend(fig, handles: dict, ncols: int, nrows: int, legend_cols: int | None = None) -> None:
    legend_cols = legend_cols or min(4, 2 * ncols)
    legend_rows = math.ceil(len(handles) / legend_cols)
    fig.tight_layout(rect=(0, (0.035 * legend_rows + 0.04) / (nrows * 0.8), 1, 1))
    fig.legend(list(handles.values()), [h.get_label() for h in handles.values()], loc="lower center",
               ncol=legend_cols, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.02))


def fig14_panels(curves: pd.DataFrame, gain: pd.DataFrame, paper_gain: dict, threshold: float, setup: str,
                 ymax: float = 1.0, label: str = ""):
    """Fig. 14 as the paper draws it: normalised latency against request rate, Orca (Oracle) and ours, one panel per
    sampling setting (``curves``: ``method`` ``"n=1"`` / ``"parallel"`` / ``"beam"``, ``width``), parallel sampling on
    the first row and beam search on the second, on a linear axis (:func:`latency_vs_rate`).

    The paper's gains (``paper.FIG14_GAIN``: ``"n1"`` for basic sampling, ``"beam_w6"`` for beam width 6) are marked
    on their panels as a star on the threshold line at the paper's gain times Orca (Oracle)'s measured sustainable rate
    there (``gain``'s ``rate_orca_oracle``; the headline rows where preemption was varied, ``sim.HEADLINE_RULE``): where ours would cross the
    threshold if it gained what the paper reports. ``setup`` (the model, GPU and trace) is the figure's title."""
    from pagedattn.repro.sim.simulator import HEADLINE_RULE

    rows = [("parallel", sorted(curves[curves.method != "beam"].width.unique())),
            ("beam", sorted(curves[curves.method == "beam"].width.unique()))]
    rows = [(m, ws) for m, ws in rows if ws]
    ncols = max(len(ws) for _, ws in rows)
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(len(rows), ncols, figsize=(3.9 * ncols, 3.4 * len(rows) + 1.2), squeeze=False)
    g = gain[gain.preemption.fillna(HEADLINE_RULE) == HEADLINE_RULE] if "preemption" in gain else gain
    marks = {("n=1", 1): paper_gain.get("n1"), ("beam", 6): paper_gain.get("beam_w6")}
    handles = {}
    for i, (method, ws) in enumerate(rows):
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(ws):
                ax.axis("off")
                continue
            n = ws[j]
            beam = method == "beam"
            d = curves[((curves.method == "beam") == beam) & (curves.width == n)]
            latency_vs_rate(ax, d, threshold, ymax)
            key = ("beam" if beam else d.method.iloc[0] if len(d) else method, n)
            if marks.get(key) is not None:
                r = g[(g.method == key[0]) & (g.width == n)]["rate_orca_oracle"]
                if len(r):
                    what = "beam width 6" if beam else "n = 1"
                    mark_paper_ratio(ax, float(r.iloc[0]), marks[key], threshold, "#f5c518",
                                     f"paper: ours at {marks[key]:g}x Orca (Oracle)'s rate ({what})")
            ax.set_xlim(left=0)
            ax.set_title(f"beam search, width {n}" if beam else
                         "basic sampling (n = 1)" if n == 1 else f"parallel sampling, n = {n}", fontsize=10)
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
    handles["off scale"] = off_scale_handle(ymax)
    fig.suptitle(setup, fontsize=11)
    _figure_legend(fig, handles, ncols, len(rows), legend_cols=3)
    if label:
        footnote(fig, label)
    return fig


def fig15_savings(sav: pd.DataFrame, paper: dict, workloads: tuple, sensitivity_trace: str | None = None,
                  title: str = "", label: str = ""):
    """Fig. 15: memory saved by sharing against n (parallel sampling) and beam width, ours (solid) beside the
    paper's (``paper.FIG15_SAVING``: dashed values per width, or a shaded range where the paper gives only a range),
    one panel per trace in ``workloads``; ``sensitivity_trace``'s parallel savings dotted on the ShareGPT panel. One
    legend for both panels, so that the paper's dashed lines and ranges are named."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.6 * len(workloads), 4.6), sharey=True, squeeze=False)
    handles = {}
    for ax, w in zip(axes[0], workloads):
        d = sav[sav.trace == w]
        for method, color, marker in (("parallel", "#1f77b4", "o"), ("beam", "#d62728", "s")):
            m = d[d.method == method].sort_values("width")
            ax.plot(m.width, m.saving_pct, marker=marker, color=color, label=f"{method} · ours")
            p = paper[w][method]
            record_paper_marks(fig, *(p.values() if isinstance(p, dict) else p))
            if isinstance(p, dict):
                ax.plot(list(p), list(p.values()), marker=marker, ls="--", color=color, alpha=0.6, mfc="white",
                        label=f"{method} · paper (per width)")
            else:
                ax.axhspan(*p, color=color, alpha=0.12, label=f"{method} · paper (range over widths 2-6)")
        if sensitivity_trace and w.startswith("sharegpt"):
            m = sav[(sav.trace == sensitivity_trace) & (sav.method == "parallel")].sort_values("width")
            ax.plot(m.width, m.saving_pct, marker="o", ls=":", color="#1f77b4",
                    label=f"parallel · ours, {TRACE_TITLES.get(sensitivity_trace, sensitivity_trace)}")
        ax.set_title(TRACE_TITLES.get(w, w), fontsize=10)
        ax.set_xlabel("n (parallel sampling) / beam width")
        ax.set_xticks(sorted(sav.width.unique()))
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    axes[0][0].set_ylabel("memory saved by sharing (%)")
    if title:
        fig.suptitle(title, fontsize=11)
    _figure_legend(fig, handles, len(workloads), 1, legend_cols=3)
    if label:
        footnote(fig, label)
    return fig


def fig14_gain_bars(o: pd.DataFrame, paper_gain: dict, title: str = "", label: str = ""):
    """Fig. 14's gains as bars: requests/s of ours and Orca (Oracle) per method (``o``: ``method`` ``"n=1"`` /
    ``"beam"``, ``system``, ``requests_per_s``, ``gain_over_orca_oracle``), each gain written over its pair, and the
    paper's gain (``paper.FIG14_GAIN``) as a black bar mark at Orca (Oracle)'s rate times it: where ours would be if it
    gained what the paper reports (in the legend)."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    labels = {"paged": "vLLM (ours)", "orca_oracle": "Orca (Oracle)"}
    piv = o.pivot(index="method", columns="system", values="requests_per_s")[["paged", "orca_oracle"]]
    piv = piv.rename(columns=labels)
    piv.plot.bar(ax=ax, rot=0, color=[SYSTEM_STYLES["vLLM (ours)"]["color"], SYSTEM_STYLES["Orca (Oracle)"]["color"]])
    top = max(piv.values.max(), (piv["Orca (Oracle)"] * [paper_gain["n1" if m == "n=1" else "beam_w6"]
                                                          for m in piv.index]).max())
    for i, m in enumerate(piv.index):
        gain = o[(o.method == m) & (o.system == "orca_oracle")]["gain_over_orca_oracle"].iloc[0]
        paper = paper_gain["n1" if m == "n=1" else "beam_w6"]
        mark = piv.loc[m, "Orca (Oracle)"] * paper
        record_paper_marks(fig, paper)
        ax.plot([i - 0.25, i + 0.01], [mark, mark], color=PAPER_COLOR, lw=2.5, ls="--",
                label=f"paper: Orca (Oracle) x the paper's gain ({paper_gain['n1']:g}x n = 1; "
                      f"{paper_gain['beam_w6']:g}x beam width 6)" if i == 0 else None)
        ax.text(i, max(piv.loc[m].max(), mark) + 0.06 * top, f"ours {gain:.2f}x, paper {paper:g}x", ha="center",
                fontsize=9, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    widths = o.groupby("method")["width"].first()
    ax.set_xticklabels(["basic sampling (n = 1)" if m == "n=1" else f"beam search, width {widths[m]}"
                        for m in piv.index])
    ax.set_ylabel("requests / s")
    ax.set_xlabel("")
    ax.set_ylim(0, top * 1.3)
    ax.grid(axis="x", visible=False)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    if label:
        footnote(fig, label)
    fig.tight_layout()
    return fig


def online_curves(curves: pd.DataFrame, threshold: float, title: str = "", label: str = "",
                  sustainable: pd.DataFrame | None = None):
    """Notebook 13: normalized latency against the request rate on live servers (solid, filled markers) and the
    simulator's prediction for the same requests and rates (dashed, open markers; none for a system without one,
    such as vLLM-CPU), one colour per system, on a linear axis as the paper's Fig. 12, with the sustainable-rate
    threshold dotted and, from ``sustainable``, each system's sustainable rate on it (:func:`mark_sustainable`:
    the curves stop below the threshold where a server falls behind)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (name, d) in enumerate(curves.groupby("label", sort=False)):
        s, d = _style(name, i), d.sort_values("rate")
        if d.nl_measured_s.notna().any():  # Orca (Max) is predicted only (online_serving.Params.predicted)
            ax.plot(d.rate, d.nl_measured_s, color=s["color"], marker=s["marker"], ls="-", lw=1.8,
                    label=f"{name}, measured")
        if d.nl_predicted_s.notna().any():  # vLLM-CPU's server has no prediction (another engine's scheduler)
            ax.plot(d.rate, d.nl_predicted_s, color=s["color"], marker=s["marker"], ls="--", lw=1.2, mfc="white",
                    label=f"{name}, simulator")
    ax.axhline(threshold, color="#888888", ls=":", lw=1, label=f"threshold {threshold:.3g} s/token")
    handles = ax.get_legend_handles_labels()[0]
    if sustainable is not None and len(sustainable):
        mark_sustainable(ax, sustainable, threshold)
        handles.append(sustainable_handle())
    ax.set_ylim(0, None)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title)
    ax.legend(handles=handles, fontsize=7, ncol=2)
    if label:
        footnote(fig, label)
    fig.tight_layout()
    return fig
